"""FP8 (e4m3) weights: per-output-channel quantization, per-token activation scaling, the _scaled_mm linear,
and the conversion of Hugging Face FP8 checkpoints (per-tensor, per-channel or 128x128-block scales)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from tandem.kernels.fp8 import (
    FP8_ALIGN,
    FP8_DTYPE,
    FP8_MAX,
    MIN_AMAX,
    W8A8_MAX_M,
    W8A16_MAX_M,
    PartialSums,
    QuantizedRows,
    quantize_activation_per_token_ref,
)

QUANTIZATION_METHODS = ("fp8",)
# Hugging Face quantization_config.quant_method values whose checkpoints hold float8_e4m3fn weights.
CHECKPOINT_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
# Activation / KV-cache scales of static schemes: tandem scales activations per token on the fly instead.
_IGNORED_SCALES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")


def check_fp8_device(device: torch.device, what: str = "fp8") -> None:
    """ValueError unless `device` is a CUDA GPU with FP8 tensor cores (compute capability >= 8.9); `what` names
    the setting in the message."""
    need = f"{what} needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper)"
    if device.type != "cuda":
        raise ValueError(f"{need}; this run is on {device.type}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"{need}; {torch.cuda.get_device_name(device)} has compute capability {major}.{minor}")


def fp8_supported_shape(out_features: int, in_features: int) -> bool:
    return out_features % FP8_ALIGN == 0 and in_features % FP8_ALIGN == 0


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (e4m3 [out, in], fp32 scale [out, 1]) with weight ~= q * scale, row max -> 448."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    q = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [out, in] x fp32 [out, 1] (or a scalar) -> fp32 [out, in]."""
    return q.float() * scale.float()


def quantize_activation_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] float -> (e4m3 [n, k] row-major, fp32 scale [n, 1]); one fused Triton kernel on CUDA."""
    if x.is_cuda:
        from tandem.kernels.triton_quant import quantize_per_token_triton  # lazy: CPU runs never import Triton

        return quantize_per_token_triton(x)
    return quantize_activation_per_token_ref(x)


def fp8_linear(
    x: torch.Tensor | QuantizedRows,  # [..., in] bfloat16, or [n, in] rows quantized by their producer
    weight: torch.Tensor,  # [out, in] float8_e4m3fn, row-major
    weight_scale: torch.Tensor,  # [out, 1] fp32
    bias: torch.Tensor | None,  # [out] in x's dtype
    defer_reduce: bool = False,  # a split-K swap-AB GEMM may return PartialSums (2-D x only)
    out: torch.Tensor | None = None,  # [n, out] in x's dtype (2-D x, unit inner stride): the result goes there
) -> torch.Tensor | PartialSums:  # [..., out] in x's dtype
    """x W^T + b with W in FP8. Up to W8A16_MAX_M rows a Triton kernel multiplies the bf16 rows by the widened
    FP8 weight (weight-only: x is not quantized); above, x is quantized per token and both scales (and the
    bias) are applied to an FP8 x FP8 product: the swap-AB Triton GEMM up to W8A8_MAX_M rows, one rowwise-
    scaled torch._scaled_mm above. No host sync and no data-dependent shape, so all capture in CUDA graphs.
    On the CPU it runs the reference (tests; the engine refuses fp8 there)."""
    if isinstance(x, QuantizedRows):
        return _given(out, _fp8_linear_quantized(x, weight, weight_scale, bias, defer_reduce))
    if not x.is_cuda:
        return _given(out, fp8_linear_reference(x, weight, weight_scale, bias))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if rows <= W8A8_MAX_M:
        from tandem.kernels.triton_quant import fp8_w8a8_matmul_triton, fp8_weight_matmul_triton

        if rows <= W8A16_MAX_M:
            y = fp8_weight_matmul_triton(x2, weight, weight_scale, bias, out=out)
        else:
            y = fp8_w8a8_matmul_triton(x2, weight, weight_scale, bias, defer=defer_reduce and x.dim() == 2,
                                       out=out)
            if isinstance(y, PartialSums):
                return y
        return y.view(*lead, y.shape[-1])
    xq, x_scale = quantize_activation_per_token(x2)
    # Rowwise scaling: scale_a [M, 1], scale_b [1, N] (fp32, unit inner stride); mat2 column-major [K, N],
    # which W.t() of the row-major [N, K] weight is.
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), bias=bias,
                         out_dtype=x.dtype)
    return _given(out, y.view(*lead, y.shape[-1]))


def _given(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y, copied into out when one is given."""
    return y if out is None else out.copy_(y)


def _fp8_linear_quantized(
    x: QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
    defer_reduce: bool = False,
) -> torch.Tensor | PartialSums:
    """fp8_linear's quantizing paths on rows a producer kernel quantized (the same values fp8_linear's own
    quantization would give): the swap-AB GEMM up to W8A8_MAX_M rows, _scaled_mm above."""
    from tandem.kernels.ops import use_triton

    rows = x.q.shape[0]
    grouped = x.scale.shape[1] > 1
    if not use_triton(x.q):  # CPU tests without the interpreter: the reference on the dequantized rows
        return fp8_linear_reference(x.dequantize(), weight, weight_scale, bias, quantize_activations=False).to(x.dtype)
    if grouped and rows > W8A8_MAX_M:  # _scaled_mm scales rows, not groups: back to rows in the model dtype
        return fp8_linear(x.dequantize().to(x.dtype), weight, weight_scale, bias, defer_reduce)
    if rows <= W8A8_MAX_M:
        from tandem.kernels.triton_quant import fp8_w8a8_matmul_quantized

        return fp8_w8a8_matmul_quantized(x.q, x.scale, weight, weight_scale, bias, x.dtype, defer=defer_reduce)
    return torch._scaled_mm(x.q, weight.t(), scale_a=x.scale, scale_b=weight_scale.view(1, -1), bias=bias,
                            out_dtype=x.dtype)


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
    quantize_activations: bool = True,
) -> torch.Tensor:
    """fp8_linear's math in fp32: x quantized per token (the W8A8 paths) or not (the GEMV and W8A16 paths),
    times the dequantized weight."""
    x2 = x.reshape(-1, x.shape[-1])
    x32 = dequantize_fp8(*quantize_activation_per_token_ref(x2)) if quantize_activations else x2.float()
    out = F.linear(x32, dequantize_fp8(weight, weight_scale), None if bias is None else bias.float())
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


# ----------------------------------------------------------------------------- FP8 checkpoints


def checkpoint_fp8_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's quantization_config when it describes FP8 weights; None without one; ValueError for
    other quantization methods (GPTQ, AWQ, ...), which tandem does not load."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"checkpoint quantization {method!r} is not supported (quant_method fp8, fbgemm_fp8, "
                         "gptq, awq or compressed-tensors)")
    if method == "compressed-tensors":
        groups = (qc.get("config_groups") or {}).values()
        weights = [g.get("weights") or {} for g in groups]
        if not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
            raise ValueError("compressed-tensors checkpoint is not FP8 (only 8-bit float weights are supported)")
    return qc


def dequantize_checkpoint_weight(
    weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None, name: str
) -> torch.Tensor:
    """FP8 [out, in] and its scale -> fp32 [out, in]. The scale multiplies (HF `weight_scale` and
    `weight_scale_inv` both do) and is a scalar, per output channel ([out] / [out, 1]), or one per block
    ([ceil(out / bo), ceil(in / bi)])."""
    out_f, in_f = weight.shape
    s = scale.float()
    if s.numel() == 1:
        return weight.float() * s.reshape(())
    if s.shape in ((out_f,), (out_f, 1)):
        return weight.float() * s.reshape(out_f, 1)
    if block_size is not None and s.dim() == 2:
        bo, bi = block_size
        if s.shape == (-(-out_f // bo), -(-in_f // bi)):
            full = s.repeat_interleave(bo, dim=0)[:out_f].repeat_interleave(bi, dim=1)[:, :in_f]
            return weight.float() * full
    raise ValueError(f"FP8 weight {name!r} {tuple(weight.shape)}: scale of shape {tuple(scale.shape)} is neither "
                     f"per-tensor, per-channel nor per-block (weight_block_size {block_size})")


def dequantize_fp8_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], quant_config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's tensors with every `X.weight` (float8) joined to its `X.weight_scale` or
    `X.weight_scale_inv` and yielded dequantized to fp32; other tensors pass through, static activation
    scales are dropped. The model loads these like a bf16 checkpoint; with quantization="fp8" its linears
    are then re-quantized per output channel (exact for per-channel checkpoints, since every row keeps its
    maximum, and at least as fine as a per-tensor or per-block scale otherwise)."""
    block = quant_config.get("weight_block_size")
    block_size = (int(block[0]), int(block[1])) if block else None
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_IGNORED_SCALES):
            continue
        for suffix in (".weight_scale_inv", ".weight_scale"):
            if name.endswith(suffix):
                prefix = name[: -len(suffix)]
                if prefix in pending_weights:
                    w = pending_weights.pop(prefix)
                    yield prefix + ".weight", dequantize_checkpoint_weight(w, tensor, block_size, prefix + ".weight")
                else:
                    pending_scales[prefix] = tensor
                break
        else:
            if tensor.dtype != FP8_DTYPE:
                if tensor.dtype.is_floating_point and tensor.element_size() == 1:
                    raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}; only float8_e4m3fn is supported")
                yield name, tensor
            elif not name.endswith(".weight") or tensor.dim() != 2:
                raise ValueError(f"FP8 tensor {name!r} of shape {tuple(tensor.shape)} is not a linear weight")
            else:
                prefix = name[: -len(".weight")]
                if prefix in pending_scales:
                    yield name, dequantize_checkpoint_weight(tensor, pending_scales.pop(prefix), block_size, name)
                else:
                    pending_weights[prefix] = tensor
    if pending_weights:
        raise ValueError(f"FP8 weights without a weight_scale: {sorted(pending_weights)[:4]}")
    if pending_scales:
        raise ValueError(f"weight scales without an FP8 weight: {sorted(pending_scales)[:4]}")
