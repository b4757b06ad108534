"""Fused Triton elementwise kernels for the decoder layer: (add +) RMSNorm, in-place rotary, SiLU-and-mul."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX, PartialSums, QuantizedRows
from tandem.kernels.triton_launch import pdl_wait, use_pdl
from tandem.kernels.triton_quant import store_quantized_row
from tandem.kernels.triton_rotary_kv import norm_rotate, token_rows

# Math is fp32; values are rounded to the storage dtype exactly where the eager PyTorch layers round
# (norm before the weight multiply, each rotary product), so GPU results track the eager path and HF.
MAX_NORM_DIM = 65536  # one program holds a whole row in registers
SILU_BLOCK = 1024  # columns per silu_and_mul program


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def partial_channels(ps_ptr, pb_ptr, offs, mask, SPLITS: tl.constexpr, HAS_PSCALE: tl.constexpr,
                     HAS_PBIAS: tl.constexpr):
    # The channel scale and bias (fp32) that sum_partials applies: weights, so a kernel may load them before its
    # PDL wait. Placeholders where there are none (sum_partials then uses neither).
    p_scale = 1.0
    p_bias = 0.0
    if SPLITS > 0:
        if HAS_PSCALE:
            p_scale = tl.load(ps_ptr + offs, mask=mask, other=0.0)
        if HAS_PBIAS:
            p_bias = tl.load(pb_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return p_scale, p_bias


@triton.jit
def sum_partials(ptrs, split_stride, mask, p_scale, p_bias, SPLITS: tl.constexpr, HAS_PSCALE: tl.constexpr,
                 HAS_PBIAS: tl.constexpr):
    # A split-K GEMM's fp32 partial sums of a row (SPLITS of them, split_stride elements apart), added in split
    # order, times the channel scale, plus the bias (from partial_channels): _split_k_reduce_kernel's arithmetic.
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLITS):
        acc += tl.load(ptrs + i * split_stride, mask=mask, other=0.0)
    if HAS_PSCALE:
        acc = acc * p_scale
    if HAS_PBIAS:
        acc = acc + p_bias
    return acc


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    inner, dim, eps,
    stride_xa, stride_xb, stride_ra, stride_rb,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
    QUANT_OUT: tl.constexpr, scale_ptr, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr,
    SPLITS: tl.constexpr, split_stride, ps_ptr, pb_ptr, HAS_PSCALE: tl.constexpr, HAS_PBIAS: tl.constexpr,
):
    # Program = one row (token, or token x head for per-head norms); rows are addressed as x[a, b, :]
    # with a = row // inner, b = row % inner, so row-strided views (slices of a fused qkv) need no copy.
    # QUANT_OUT: the output row, rounded to x's dtype, is written quantized per token (e4m3 at out_ptr, its
    # scale at scale_ptr) exactly as quantize_per_token_triton would quantize it, for an FP8 linear.
    # SPLITS > 0 (PartialSums, with a residual): x_ptr holds a split-K GEMM's fp32 partial sums, SPLITS
    # of them split_stride apart; the row is their sum in split order times the channel scale (ps_ptr) plus
    # the bias (pb_ptr), rounded to the residual's dtype: what _split_k_reduce_kernel would have written.
    row = tl.program_id(0).to(tl.int64)
    a = row // inner
    b = row % inner
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
    p_scale, p_bias = partial_channels(ps_ptr, pb_ptr, offs, mask, SPLITS, HAS_PSCALE, HAS_PBIAS)  # weights too
    pdl_wait(USE_PDL)
    if SPLITS > 0:
        acc = sum_partials(x_ptr + a * stride_xa + b * stride_xb + offs, split_stride, mask, p_scale, p_bias,
                           SPLITS, HAS_PSCALE, HAS_PBIAS)
        x = acc.to(res_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + a * stride_xa + b * stride_xb + offs, mask=mask, other=0.0)
    s = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + a * stride_ra + b * stride_rb + offs, mask=mask, other=0.0)
        # x + residual is rounded to the activation dtype before the norm, as in eager mode.
        summed = (s + r.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + row * dim + offs, summed, mask=mask)
        s = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / dim + eps)
    normed = (s * rstd).to(x.dtype).to(tl.float32)  # F.rms_norm(x.float()).to(x.dtype)
    if QUANT_OUT:
        y = (normed * w).to(x.dtype).to(tl.float32)
        store_quantized_row(y, offs, mask, out_ptr + row * dim, scale_ptr + row, FP8_MAX_C, MIN_AMAX_C)
    else:
        tl.store(out_ptr + row * dim + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows3(x: torch.Tensor) -> torch.Tensor:
    """[..., dim] -> a [A, B, dim] view (copy only if the leading dims cannot be expressed by two strides)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _rms_norm(x: torch.Tensor | PartialSums, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
              fp8_out: bool = False):
    # x: rows, or a split-K GEMM's PartialSums [splits, rows, dim] (contiguous, with a residual whose rows
    # give the dtype the kernel rounds their sum to), which the kernel adds up in split order.
    parts = x if isinstance(x, PartialSums) else None
    if parts is not None:
        if residual is None or residual.stride(-1) != 1 or not parts.ws.is_contiguous():
            raise ValueError(f"PartialSums {tuple(parts.ws.shape)} need contiguous partial sums and a residual with a "
                             f"unit inner stride, got {None if residual is None else tuple(residual.stride())}")
        shape, dtype, device = parts.shape, parts.dtype, parts.ws.device
    else:
        shape, dtype, device = x.shape, x.dtype, x.device
    dim = shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the normalized dim {dim}")
    if dim > MAX_NORM_DIM:
        raise ValueError(f"rms_norm_triton supports a last dim up to {MAX_NORM_DIM}, got {dim}")
    if fp8_out and (len(shape) != 2 or weight.dtype != dtype):
        raise ValueError(f"fp8_out takes [tokens, dim] rows with a weight in their dtype, got {tuple(shape)} "
                         f"{dtype} and a {weight.dtype} weight")
    out = torch.empty(shape, dtype=FP8_DTYPE if fp8_out else torch.promote_types(weight.dtype, dtype), device=device)
    scale = torch.empty(shape[0], 1, dtype=torch.float32, device=device) if fp8_out else None
    new_res = torch.empty(shape, dtype=dtype, device=device) if residual is not None else None
    if out.numel() == 0:
        return (QuantizedRows(out, scale, dtype) if fp8_out else out), new_res
    if parts is None:
        x3 = _as_rows3(x)
        split_args = dict(SPLITS=0, split_stride=0, ps_ptr=out, pb_ptr=out, HAS_PSCALE=False, HAS_PBIAS=False)
    else:
        x3 = parts.ws[0].unsqueeze(1)  # [rows, 1, dim]: the first split; the kernel steps to the others
        split_args = dict(SPLITS=parts.ws.shape[0], split_stride=x3.numel(),
                          ps_ptr=parts.scale if parts.scale is not None else out,
                          pb_ptr=parts.bias if parts.bias is not None else out,
                          HAS_PSCALE=parts.scale is not None, HAS_PBIAS=parts.bias is not None)
    r3 = _as_rows3(residual) if residual is not None else x3
    if r3.shape != x3.shape or r3.dtype != dtype:
        raise ValueError(f"residual {tuple(r3.shape)} {r3.dtype} does not match x {tuple(x3.shape)} {dtype}")
    rows = x3.shape[0] * x3.shape[1]
    block = triton.next_power_of_2(dim)
    pdl = use_pdl(device)
    _rms_norm_kernel[(rows,)](
        x3, r3, weight.contiguous(), out, new_res if new_res is not None else out,
        x3.shape[1], dim, float(eps),
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        HAS_RESIDUAL=residual is not None, BLOCK_D=block, USE_PDL=pdl,
        QUANT_OUT=fp8_out, scale_ptr=scale if fp8_out else out, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX,
        **split_args, num_warps=_num_warps(block), launch_pdl=bool(pdl),
    )
    return (QuantizedRows(out, scale, dtype) if fp8_out else out), new_res


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_out: bool = False):
    """RMSNorm over x's last dim (any leading shape; row-strided views read in place); contiguous output.
    fp8_out ([tokens, dim] x): the output quantized per token for an FP8 linear, as QuantizedRows."""
    return _rms_norm(x, None, weight, eps, fp8_out)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor | PartialSums, residual: torch.Tensor, weight: torch.Tensor, eps: float, fp8_out: bool = False
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual) in one pass; neither input is written. fp8_out: the first
    quantized per token (QuantizedRows), as rms_norm_triton's. x may be a split-K GEMM's PartialSums, which
    the kernel adds up first (no reduce kernel)."""
    return _rms_norm(x, residual, weight, eps, fp8_out)


# ----------------------------------------------------------------------------- rotary


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    num_q_heads, num_k_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_ct, stride_cd, stride_st, stride_sd,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program = one token: its cos/sin row is loaded once and applied to all q and k heads.
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    c = tl.load(cos_ptr + t * stride_ct + offs_d * stride_cd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + offs_d * stride_sd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    # In place, no norm (its weight pointer and eps are unused): the rotary half of the fused kernel's body.
    q = q_ptr + t * stride_qt
    norm_rotate(q, stride_qh, stride_qd, num_q_heads, q, 0.0, c, s, offs_d, d_mask, HALF, BLOCK_HQ, False,
                q, stride_qh, stride_qd)
    k = k_ptr + t * stride_kt
    norm_rotate(k, stride_kh, stride_kd, num_k_heads, k, 0.0, c, s, offs_d, d_mask, HALF, BLOCK_HK, False,
                k, stride_kh, stride_kd)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: rotate q [T, Hq, D] and k [T, Hk, D] (strided views allowed) by cos/sin of 2 * half <= D dims.

    Pairs (i, i + half) of the first 2 * half dims rotate; any remaining dims (partial rotary) are untouched.
    """
    num_tokens, _, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    cos, sin = token_rows(cos, num_tokens), token_rows(sin, num_tokens)
    half = cos.shape[1]
    if sin.shape != cos.shape or 2 * half > head_dim:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit head_dim {head_dim}")
    if num_tokens == 0:
        return
    block_half = triton.next_power_of_2(half)
    block_hq, block_hk = triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1])
    pdl = use_pdl(q.device)
    _rotary_kernel[(num_tokens,)](
        q, k, cos, sin,
        q.shape[1], k.shape[1],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        HALF=half, BLOCK_HALF=block_half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, USE_PDL=pdl,
        num_warps=_num_warps(block_hq * block_half), launch_pdl=bool(pdl),
    )


# ----------------------------------------------------------------------------- SiLU and mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # Program = (row, column block): the op has no reduction, so a row is split to fill the GPU at batch 1.
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)  # F.silu rounds before the multiply
    tl.store(out_ptr + row * inter + offs, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] (gate then up) -> silu(gate) * up, [..., I] contiguous."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    pdl = use_pdl(x.device)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, out, inter, x2.stride(0), BLOCK=block, USE_PDL=pdl, num_warps=_num_warps(block), launch_pdl=bool(pdl),
    )
    return out
