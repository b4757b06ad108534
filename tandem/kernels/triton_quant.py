"""Per-token FP8 activation quantization in one Triton pass: row amax, scale, scaled e4m3 cast."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.layers.quantization import FP8_DTYPE, FP8_MAX, MIN_AMAX

MAX_QUANT_DIM = 65536  # one program holds a whole row in registers


@triton.jit
def _quant_per_token_kernel(
    x_ptr, q_ptr, scale_ptr, dim, stride_x,
    FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Program = one token. Same math as quantize_activation_per_token_ref: fp32 amax, scale = amax / 448,
    # IEEE-rounded division (div_rn: Triton's `/` is approximate), clamp, round-to-nearest-even e4m3 cast.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX_C)
    scale = tl.math.div_rn(amax, FP8_MAX_C)
    q = tl.math.div_rn(x, tl.broadcast_to(scale, [BLOCK_D]))
    q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + row * dim + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] (unit inner stride; rows may be strided) -> (e4m3 [n, k] contiguous, fp32 scale [n, 1])."""
    if x.dim() != 2:
        raise ValueError(f"quantize_per_token_triton takes [n, k], got shape {tuple(x.shape)}")
    n, dim = x.shape
    if dim > MAX_QUANT_DIM:
        raise ValueError(f"quantize_per_token_triton supports rows up to {MAX_QUANT_DIM}, got {dim}")
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(n, dim, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=x.device)
    if n == 0:
        return q, scale
    block = triton.next_power_of_2(dim)
    _quant_per_token_kernel[(n,)](
        x, q, scale, dim, x.stride(0),
        FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, BLOCK_D=block, num_warps=min(max(block // 512, 1), 16),
    )
    return q, scale
