"""Linear and embedding layers whose parameters start uninitialized (the loader fills every one); Linear
optionally holds its weight in FP8 with per-output-channel scales."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.fp8 import FP8_DTYPE, W8A8_MAX_M, PartialSums, QuantizedRows, fp8_quantizes_activations
from tandem.kernels.ops import use_gemv, use_skinny, use_triton
from tandem.layers.activation import silu_and_mul
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

    def forward(self, x: torch.Tensor | QuantizedRows, defer_reduce: bool = False) -> torch.Tensor | PartialSums:
        """defer_reduce (the output feeds only RMSNorm's add + norm, which takes PartialSums): a GEMM split
        over K may return its partial sums instead of running the reduce kernel."""
        if isinstance(x, QuantizedRows):  # from an RMSNorm / SiLU-and-mul kernel, for this FP8 weight
            if self.weight_scale is None:
                raise ValueError("QuantizedRows reach only linears with FP8 weights; this one holds "
                                 f"{self.weight.dtype}")
            return fp8_linear(x, self.weight, self.weight_scale, self.bias, defer_reduce)
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
        decode batch sizes on CUDA, else the projection followed by silu_and_mul. fp8_out (the result feeds
        an FP8 linear): where that linear would quantize it per token, the silu_and_mul kernel writes it
        quantized (QuantizedRows). Quantized rows up to W8A8_MAX_M on a GPU (or the interpreter) run the W8A8
        GEMM with silu(gate) * up in its epilogue, quantized for fp8_out from the row maxima it writes."""
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

    def _skinny(self, x: torch.Tensor, gated: bool, defer: bool = False) -> torch.Tensor | PartialSums:
        from tandem.kernels.triton_quant import skinny_matmul_triton  # lazy: CPU runs never import Triton

        out = skinny_matmul_triton(x.reshape(-1, self.in_features), self.weight, self.bias, gated=gated, defer=defer)
        return out if isinstance(out, PartialSums) else out.view(*x.shape[:-1], out.shape[-1])

    def _gemv(self, x: torch.Tensor, gated: bool) -> torch.Tensor:
        from tandem.kernels.triton_gemv import gemv_triton  # lazy: CPU runs never import Triton

        out = gemv_triton(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias, gated=gated)
        return out.view(*x.shape[:-1], out.shape[-1])

    def quantize_fp8_(self) -> bool:
        """Replaces the loaded weight by its FP8 copy and per-output-channel scales (the high-precision copy
        is freed); False, and nothing changes, for shapes _scaled_mm cannot take (not multiples of 16)."""
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
