"""One Triton kernel per layer and step for (per-head q/k RMSNorm +) rotary on q and k + the paged KV-cache write."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.triton_kv import is_fp8_cache, to_cache
from tandem.kernels.triton_launch import pdl_wait, use_pdl

# Math is fp32, rounded to the storage dtype where the eager layers round (norm output before and after
# the weight multiply, each rotary product), so the fused path tracks RMSNorm + apply_rotary + write_kv_ref.


@triton.jit
def norm_rotate(base_ptr, stride_h, stride_d, num_heads, w_ptr, eps, c, s, offs_d, d_mask,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
                 out_ptr, out_stride_h, out_stride_d):
    # Loads all heads of one token ([BLOCK_H, BLOCK_HALF] per half), RMS-normalizes each head over its
    # 2 * HALF dims when HAS_NORM, rotates pairs (i, i + HALF), stores them at out_ptr with its own strides
    # (base_ptr's for in place); returns the rotated halves.
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < num_heads) & d_mask[None, :]
    ptrs1 = base_ptr + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d
    ptrs2 = ptrs1 + HALF * stride_d
    x1 = tl.load(ptrs1, mask=mask, other=0.0)
    x2 = tl.load(ptrs2, mask=mask, other=0.0)
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)  # [BLOCK_H]
        rstd = tl.rsqrt(ss / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        f1 = ((f1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        f2 = ((f2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    o1 = ((f1 * c).to(dt).to(tl.float32) - (f2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32)).to(dt)
    out1 = out_ptr + offs_h[:, None] * out_stride_h + offs_d[None, :] * out_stride_d
    tl.store(out1, o1, mask=mask)
    tl.store(out1 + HALF * out_stride_d, o2, mask=mask)
    return o1, o2


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr,
    num_q_heads, num_kv_heads, eps,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_oqt, stride_oqh, stride_oqd,
    stride_ct, stride_cd, stride_st, stride_sd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    PAGE: tl.constexpr, HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr, KV_FP8: tl.constexpr,
):
    # Program = one token: cos/sin loaded once for all its q and k heads; k (rotated) and v go to the cache,
    # the rotated q to q_out_ptr (q's own rows when the caller rotates in place).
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    c = tl.load(cos_ptr + t * stride_ct + offs_d * stride_cd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + offs_d * stride_sd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    norm_rotate(q_ptr + t * stride_qt, stride_qh, stride_qd, num_q_heads, qw_ptr, eps, c, s, offs_d, d_mask,
                 HALF, BLOCK_HQ, HAS_NORM, q_out_ptr + t * stride_oqt, stride_oqh, stride_oqd)
    k1, k2 = norm_rotate(k_ptr + t * stride_kt, stride_kh, stride_kd, num_kv_heads, kw_ptr, eps, c, s, offs_d,
                          d_mask, HALF, BLOCK_HK, HAS_NORM, k_ptr + t * stride_kt, stride_kh, stride_kd)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: padding token, nothing written
        page = slot // PAGE
        in_page = slot % PAGE
        offs_h = tl.arange(0, BLOCK_HK)
        mask = (offs_h[:, None] < num_kv_heads) & d_mask[None, :]
        dst = k_cache_ptr + page * stride_kcb + in_page * stride_kcs + offs_h[:, None] * stride_kch \
            + offs_d[None, :] * stride_kcd
        tl.store(dst, to_cache(k1, k_cache_ptr, KV_FP8), mask=mask)
        tl.store(dst + HALF * stride_kcd, to_cache(k2, k_cache_ptr, KV_FP8), mask=mask)
        src = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
        dst = v_cache_ptr + page * stride_vcb + in_page * stride_vcs + offs_h[:, None] * stride_vch \
            + offs_d[None, :] * stride_vcd
        v1 = tl.load(src, mask=mask, other=0.0)
        v2 = tl.load(src + HALF * stride_vd, mask=mask, other=0.0)
        tl.store(dst, to_cache(v1, v_cache_ptr, KV_FP8), mask=mask)
        tl.store(dst + HALF * stride_vcd, to_cache(v2, v_cache_ptr, KV_FP8), mask=mask)


def token_rows(x: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cos/sin [num_tokens, 1, half] (RotaryEmbedding.forward) or [num_tokens, half] -> a [num_tokens, half] view."""
    if x.dim() == 3 and x.shape[1] == 1:
        x = x[:, 0]
    if x.dim() != 2 or x.shape[0] != num_tokens:
        raise ValueError(f"cos/sin must be [num_tokens, (1,) rotary_dim // 2], got {tuple(x.shape)}")
    return x


def check_rotary_args(
    num_tokens: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks every kernel with a fused (q/k norm +) full rotary + KV write makes (this file's, and the decode
    attention kernel's with NewTokens); returns cos and sin as [num_tokens, head_dim // 2] rows."""
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping must be 1-D with >= {num_tokens} entries, got {tuple(slot_mapping.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("pass both q and k norm weights, or neither")
    if q_norm_weight is not None and (q_norm_weight.shape != (head_dim,) or k_norm_weight.shape != (head_dim,)):  # type: ignore[union-attr]
        raise ValueError(f"norm weights must be [{head_dim}]")
    cos, sin = token_rows(cos, num_tokens), token_rows(sin, num_tokens)
    if sin.shape != cos.shape or 2 * cos.shape[1] != head_dim:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)}: the fused kernel rotates all "
                         f"{head_dim} dims (no partial rotary)")
    return cos, sin


def rotary_write_kv_triton(
    q: torch.Tensor,  # [T, num_heads, head_dim], strided views (slices of a fused qkv) allowed
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [T, (1,) head_dim // 2]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [>= T] int64 (or int32); -1 = skip
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]; both or neither
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    q_out: torch.Tensor | None = None,  # [T, num_heads, head_dim]: the rotated q goes here instead (q unchanged)
) -> None:
    """In place: q and k <- rotary(rms_norm(x) * w if norm weights else x); rotated k and v -> cache slots.
    With q_out the rotated q is written there and q is only read."""
    num_tokens, num_heads, head_dim = q.shape
    if q_out is None:
        q_out = q
    elif q_out.shape != q.shape or q_out.dtype != q.dtype:
        raise ValueError(f"q_out {tuple(q_out.shape)} {q_out.dtype} must match q {tuple(q.shape)} {q.dtype}")
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit k {tuple(k.shape)}")
    cos, sin = check_rotary_args(num_tokens, head_dim, cos, sin, slot_mapping, q_norm_weight, k_norm_weight)
    has_norm = q_norm_weight is not None
    half = cos.shape[1]
    if num_tokens == 0:
        return
    qw = q_norm_weight.contiguous() if has_norm else cos  # type: ignore[union-attr]
    kw = k_norm_weight.contiguous() if has_norm else cos  # type: ignore[union-attr]
    block_half = triton.next_power_of_2(half)
    block_hq, block_hk = triton.next_power_of_2(num_heads), triton.next_power_of_2(k.shape[1])
    pdl = use_pdl(q.device)
    _rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, cos, sin, qw, kw, k_cache, v_cache, slot_mapping, q_out,
        num_heads, k.shape[1], float(eps),
        *q.stride(), *k.stride(), *v.stride(), *q_out.stride(),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        *k_cache.stride(), *v_cache.stride(),
        HALF=half, BLOCK_HALF=block_half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        PAGE=k_cache.shape[1], HAS_NORM=has_norm, USE_PDL=pdl, KV_FP8=is_fp8_cache(k_cache),
        num_warps=min(max(block_hq * block_half // 256, 1), 16), launch_pdl=bool(pdl),
    )
