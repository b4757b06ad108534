"""Linear and embedding layers whose parameters start uninitialized (the loader fills every one); Linear
optionally holds its weight in FP8 with per-output-channel scales, or as 4- / 8-bit integer codes (int_quant)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.fp8 import FP8_DTYPE, W8A8_MAX_M, PartialSums, QuantizedRows, fp8_quantizes_activations
from tandem.kernels.int_weight import IntWeight, repack_int_weight
from tandem.kernels.lora import lora_in_gemv, lora_in_skinny, lora_skinny_rows
from tandem.kernels.ops import use_gemv, use_skinny, use_triton
from tandem.layers.activation import silu_and_mul
from tandem.layers.int_quant import PackedIntWeight, check_int_layout, int_linear, quantize_rtn, rtn_group_size
from tandem.layers.quantization import fp8_linear, fp8_supported_shape, quantize_weight_fp8


class Linear(nn.Module):
    """y = x W^T + b; the weight is allocated with torch.empty on the ambient device and dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # [out, 1] fp32 once quantize_fp8_() has turned the weight into float8_e4m3fn; None in the model dtype.
        self.register_buffer("weight_scale", None)
        # With integer weights (use_int_weight_ / quantize_int_): the bit width and the group size in columns;
        # the weight parameter is then replaced by qweight, scales, zeros (and perm) in the tandem int-N layout.
        self.int_bits = 0
        self.group_size = 0
        # With LoRA adapters (tandem.lora): an object whose add_beside(x, base) adds each token's adapter delta onto
        # the base output base() in place and whose shrink(x) gives the decode GEMV's epilogue operands; None without.
        self.lora = None

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether the kernel producing this linear's input should hand it quantized per token (QuantizedRows): FP8
        weights, and no LoRA adapters (whose shrink reads the rows in the model dtype; the FP8 product then takes
        them unquantized too, as the weight-only kernels do)."""
        return self.weight_scale is not None and self.lora is None

    def forward(self, x: torch.Tensor | QuantizedRows, defer_reduce: bool = False) -> torch.Tensor | PartialSums:
        if self.lora is not None:  # base output + each token's adapter delta
            fused = self._fused_lora(x)
            if fused == "gemv":
                return self._gemv(x, gated=False, with_lora=True)  # type: ignore[arg-type]
            if fused == "skinny":
                return self._skinny(x, gated=False, defer=defer_reduce and x.dim() == 2, with_lora=True)  # type: ignore[arg-type]
            # The base output, then the delta (into the first partial sums where a split-K GEMM defers its reduce
            # to the norm: not past an FP8 channel scale); the shrink runs beside it on the GPU.
            defer = defer_reduce and self.weight_scale is None
            return self.lora.add_beside(x, lambda: self.base_forward(x, defer))
        return self.base_forward(x, defer_reduce)

    def _fused_lora(self, x: torch.Tensor | QuantizedRows) -> str | None:
        """The decode kernel of this LoRA target that adds the delta in its epilogue, after a shrink kernel
        ("gemv" or "skinny", the kernel base_forward would run): two kernels for base + delta instead of three
        (four with the gate/up projection's silu_and_mul, and a reduce kernel where a K split could have left
        it to the norm); None: the separate kernels after the base output."""
        if isinstance(x, QuantizedRows) or self.int_bits or not lora_in_gemv():
            return None
        if use_gemv(x, self.in_features, self.weight_scale is not None):
            return "gemv"
        if self.weight_scale is None and lora_in_skinny() and (use_skinny(x, self.in_features)
                                                               or lora_skinny_rows(x, self.in_features)):
            return "skinny"
        return None

    def base_forward(self, x: torch.Tensor | QuantizedRows, defer_reduce: bool = False) -> torch.Tensor | PartialSums:
        """defer_reduce (the output feeds only RMSNorm's add + norm, which takes PartialSums): a GEMM split
        over K may return its partial sums instead of running the reduce kernel."""
        if isinstance(x, QuantizedRows):  # from an RMSNorm / SiLU-and-mul kernel, for this FP8 weight
            if self.weight_scale is None:
                raise ValueError("QuantizedRows reach only linears with FP8 weights; this one holds "
                                 f"{'integer codes' if self.int_bits else self.weight.dtype}")
            return fp8_linear(x, self.weight, self.weight_scale, self.bias, defer_reduce)
        if self.int_bits:
            return self._int_forward(x, defer_reduce)
        if use_gemv(x, self.in_features, self.weight_scale is not None):
            return self._gemv(x, gated=False)
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias, defer_reduce)
        if use_skinny(x, self.in_features):
            return self._skinny(x, gated=False, defer=defer_reduce and x.dim() == 2)
        return F.linear(x, self.weight, self.bias)

    def forward_silu_and_mul(
        self, x: torch.Tensor | QuantizedRows, fp8_out: bool = False
    ) -> torch.Tensor | QuantizedRows:
        """silu(gate) * up of this merged gate/up projection (gate rows first): one weight-streaming kernel at
        decode batch sizes on CUDA (integer weights: at one bf16 row), else the projection followed by
        silu_and_mul. fp8_out (the result feeds an FP8 linear): where that linear would quantize it per token, the
        silu_and_mul kernel writes it quantized (QuantizedRows). Quantized rows up to W8A8_MAX_M on a GPU (or the
        interpreter) run the W8A8 GEMM with silu(gate) * up in its epilogue, quantized for fp8_out from the row
        maxima it writes."""
        if self.lora is not None:
            fused = self._fused_lora(x)
            if fused == "gemv":
                return self._gemv(x, gated=True, with_lora=True)  # type: ignore[arg-type]
            if fused == "skinny":
                return self._skinny(x, gated=True, with_lora=True)  # type: ignore[arg-type]
            return self.lora.add_beside(x, lambda: self.base_forward(x), gated=True)  # type: ignore[return-value]
        if self.int_bits:  # one kernel at one bf16 row on a GPU, as the GEMV below
            return self._int_forward(x, gated=True)  # type: ignore[return-value]
        if isinstance(x, QuantizedRows):
            if self.bias is None and x.q.shape[0] <= W8A8_MAX_M and use_triton(x.q):
                from tandem.kernels.triton_quant import fp8_w8a8_gated  # lazy: CPU runs never import Triton

                out = fp8_w8a8_gated(x.q, x.scale, self.weight, self.weight_scale, x.dtype, quantize=fp8_out)
                return QuantizedRows(*out, x.dtype) if fp8_out else out
        else:
            if use_gemv(x, self.in_features, self.weight_scale is not None):
                return self._gemv(x, gated=True)
            if self.weight_scale is None and use_skinny(x, self.in_features):
                return self._skinny(x, gated=True)
        y = self(x)
        if fp8_out and y.dim() == 2 and fp8_quantizes_activations(y.shape[0]) and use_triton(y):
            from tandem.kernels.triton_quant import quantize_per_token_triton  # lazy: CPU runs never import Triton

            return QuantizedRows(*quantize_per_token_triton(y, silu_and_mul=True), y.dtype)
        return silu_and_mul(y)

    def _skinny(self, x: torch.Tensor, gated: bool, defer: bool = False,
                with_lora: bool = False) -> torch.Tensor | PartialSums:
        from tandem.kernels.triton_quant import skinny_matmul_triton  # lazy: CPU runs never import Triton

        x2 = x.reshape(-1, self.in_features)
        lora = self.lora.shrink(x2) if with_lora else None  # base + each token's delta (see _fused_lora)
        out = skinny_matmul_triton(x2, self.weight, self.bias, gated=gated, defer=defer, lora=lora)
        return out if isinstance(out, PartialSums) else out.view(*x.shape[:-1], out.shape[-1])

    def _gemv(self, x: torch.Tensor, gated: bool, with_lora: bool = False) -> torch.Tensor:
        from tandem.kernels.triton_gemv import gemv_triton  # lazy: CPU runs never import Triton

        x2 = x.reshape(-1, self.in_features)
        lora = self.lora.shrink(x2) if with_lora else None  # base + each token's delta (see _fused_lora)
        out = gemv_triton(x2, self.weight, self.weight_scale, self.bias, gated=gated, lora=lora)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _int_forward(self, x: torch.Tensor, defer_reduce: bool = False, gated: bool = False
                     ) -> torch.Tensor | PartialSums:
        """The integer weight's product (gated: silu(gate) * up of it; defer_reduce: as base_forward's)."""
        repacked = self._kernel_int_weight(x)  # first: on a GPU it replaces the int-N layout (packed_weight None)
        perm = getattr(self, "perm", None)
        if perm is not None:
            x = self._columns_input(x)
        return int_linear(x, self.packed_weight(), self.bias, repacked, None if perm is None else perm.data,
                          defer_reduce=defer_reduce, gated=gated)

    def _columns_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input an act-order weight's `perm` indexes: x itself (a row-parallel layer over several ranks
        gathers the ranks' slices)."""
        return x

    def _kernel_int_weight(self, x: torch.Tensor) -> IntWeight | None:
        """The GPU kernels' layout of the integer weight: made at placement (repack_int_, which the loader runs on
        a GPU), else at the first forward that runs the kernels (the KV budget's profiling forward, before any
        graph capture), where on a GPU it replaces the checkpoint layout too; None where they do not run."""
        if self.kernel_int_weight is not None:
            return self.kernel_int_weight
        if not use_triton(x) or (x.is_cuda and x.dtype == torch.float32):
            return None
        if x.is_cuda:
            self.repack_int_()
        else:  # the interpreter (tests): both layouts kept
            self.kernel_int_weight = repack_int_weight(self.qweight.data, self.scales.data, self.zeros.data,
                                                       self.int_bits, self.group_size)
        return self.kernel_int_weight

    def repack_int_(self) -> None:
        """Holds the integer weight in the kernels' layout only: qweight, scales, zeros (the tandem int-N layout)
        are replaced by the parameters words, scales, mins of repack_int_weight (scales shared), and the
        kernel_int_weight views them; perm stays. One copy of the weight on the device, made once the checkpoint
        is loaded. Paths that run no kernel (the CPU, TANDEM_REFERENCE_KERNELS=1) then dequantize that layout."""
        if not self.int_bits or not hasattr(self, "qweight"):
            return
        w = repack_int_weight(self.qweight.data, self.scales.data, self.zeros.data, self.int_bits, self.group_size)
        del self.qweight, self.zeros
        self.words = nn.Parameter(w.words, requires_grad=False)  # int32 [out, in * bits // 32], in tiles (w.tiled)
        self.scales = nn.Parameter(w.scales, requires_grad=False)  # [out, groups]: the same storage as before
        self.mins = nn.Parameter(w.mins, requires_grad=False)  # [out, groups]: -zero * scale
        self.kernel_int_weight = IntWeight(self.words.data, self.scales.data, self.mins.data, w.bits, w.group_size,
                                           w.tiled)

    def packed_weight(self) -> PackedIntWeight | None:
        """The integer weight's tensors in the tandem int-N layout (views of this layer's parameters); None once
        repack_int_ has replaced them by the kernels' layout."""
        if not hasattr(self, "qweight"):
            return None
        perm = getattr(self, "perm", None)
        return PackedIntWeight(self.qweight.data, self.scales.data, self.zeros.data, self.int_bits, self.group_size,
                               None if perm is None else perm.data)

    def use_int_weight_(self, bits: int, group_size: int, act_order: bool = False, name: str = "linear") -> None:
        """Replaces the (unloaded) weight by empty integer parameters for a checkpoint to fill: qweight, scales,
        zeros in the tandem int-N layout, and perm (int64 [in]) with act order. group_size -1: one group per
        row of this layer's (local) columns. ValueError naming the layer when its shape cannot take them."""
        group = check_int_layout(name, bits, group_size, self.out_features, self.in_features)
        device, dtype = self.weight.device, self.weight.dtype
        packed_cols = self.in_features * bits // 8
        num_groups = self.in_features // group
        del self.weight
        self._set_int(PackedIntWeight(
            torch.empty(self.out_features, packed_cols, dtype=torch.uint8, device=device),
            torch.empty(self.out_features, num_groups, dtype=dtype, device=device),
            torch.empty(self.out_features, num_groups, dtype=dtype, device=device),
            bits, group,
            torch.empty(self.in_features, dtype=torch.int64, device=device) if act_order else None,
        ))

    def quantize_int_(self, bits: int, group_size: int | None = None, name: str = "linear") -> None:
        """Replaces the loaded weight by its round-to-nearest integer codes (quantization int4 / int8; group_size
        None: rtn_group_size of the local input columns); the full-precision weight is freed."""
        if self.int_bits:
            return
        group = rtn_group_size(self.in_features, name) if group_size is None else group_size
        packed = quantize_rtn(self.weight.data, bits, group, name)
        del self.weight
        self._set_int(packed)

    def _set_int(self, packed: PackedIntWeight) -> None:
        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        self.qweight, self.scales, self.zeros = param(packed.qweight), param(packed.scales), param(packed.zeros)
        if packed.perm is not None:
            self.perm = param(packed.perm)
        self.int_bits, self.group_size = packed.bits, packed.group_size
        self.kernel_int_weight: IntWeight | None = None  # made at the first forward that runs the GPU kernels

    def quantize_fp8_(self) -> bool:
        """Replaces the loaded weight by its FP8 copy and per-output-channel scales (the high-precision copy
        is freed); False, and nothing changes, for shapes _scaled_mm cannot take (not multiples of 16)."""
        if self.int_bits:
            return False
        if self.weight.dtype == FP8_DTYPE:
            return True
        if not fp8_supported_shape(*self.weight.shape):  # the local shape (tensor-parallel shards included)
            return False
        q, scale = quantize_weight_fp8(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale
        return True


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)



def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                   weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """[n, hidden] x [vocab, hidden]^T -> [n, vocab] in the model dtype (bf16 on the GPU: the sampler reads
    half the bytes, and greedy argmax needs no float32 copy; bf16 -> fp32 is exact where a path needs it).

    On the CPU a few rows against a vocabulary-sized weight run ~30% faster as W @ h^T (the long
    vocabulary dimension becomes the GEMM's M); on CUDA cuBLAS picks well either way. `out` ([n, vocab], the
    model dtype) receives the result when given. With weight_scale ([vocab, 1] fp32) the weight is FP8
    (quantize_lm_head) and the logits come from fp8_linear, as any FP8 projection's output does.
    """
    if weight_scale is not None:
        if use_gemv(hidden, weight.shape[1], fp8=True):  # a few rows: the weight-streaming GEMV, as Linear runs
            from tandem.kernels.triton_gemv import gemv_triton  # lazy: CPU runs never import Triton

            logits = gemv_triton(hidden, weight, weight_scale)
            return logits if out is None else out.copy_(logits)
        return fp8_linear(hidden, weight, weight_scale, None, out=out)
    if hidden.device.type == "cpu" and hidden.shape[0] <= 64:
        logits = torch.mm(weight, hidden.t()).t()
        return logits if out is None else out.copy_(logits)
    if out is not None:
        return torch.mm(hidden, weight.t(), out=out)  # straight into a static buffer (the decode graphs')
    return F.linear(hidden, weight)
