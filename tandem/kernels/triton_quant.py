"""Per-token FP8 activation quantization in one Triton pass: row amax, scale, scaled e4m3 cast."""

from __future__ import annotations

import functools

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


# ----------------------------------------------------------------------------- small-M FP8-weight GEMM


@triton.jit
def _fp8_weight_matmul_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program = BLOCK_M rows x BLOCK_N output channels over the whole K (no split-K: fixed summation order,
    # so a row's result does not depend on the batch it is in). The e4m3 weight tile is widened to x's
    # dtype in registers (exact: e4m3 values are bf16/fp16 values) and the channel scale applied at the end.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_weight_matmul_triton(
    x: torch.Tensor,  # [M, K] bf16/fp16 (fp32 in the interpreter), unit inner stride
    weight: torch.Tensor,  # [N, K] float8_e4m3fn row-major
    weight_scale: torch.Tensor,  # [N, 1] fp32
    bias: torch.Tensor | None,  # [N]
    tile: dict[str, int] | None = None,  # overrides BLOCK_N / BLOCK_K / num_warps / num_stages (tuning sweeps)
) -> torch.Tensor:  # [M, N] in x's dtype
    """x (W * scale)^T + b for a few rows: reads the FP8 weight once, at up to one program per SM."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = max(16, triton.next_power_of_2(m))
    block_k = 256 if k % 256 == 0 else 128
    # Narrow tiles when wide ones would leave SMs idle: the weight stream is the whole cost at small M.
    sms = _num_sms(x.device.index) if x.is_cuda else 132
    block_n = 64 if triton.cdiv(n, 64) >= sms else 32
    cfg = {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3, **(tile or {})}
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, block_m))
    _fp8_weight_matmul_kernel[grid](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, BLOCK_M=block_m, **cfg,
    )
    return out


@functools.lru_cache(maxsize=None)
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).multi_processor_count
