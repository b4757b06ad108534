"""Triton kernel that scatters one step's K/V rows into the paged KV cache."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8 import FP8_DTYPE, FP8_MAX
from tandem.kernels.triton_launch import pdl_wait, use_pdl

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_cache(x, cache_ptr, KV_FP8: tl.constexpr):
    # x as the cache at cache_ptr stores it (reference.to_cache_dtype): an FP8 cache (scale 1) saturates at
    # +-448, then rounds to nearest even.
    if KV_FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -_FP8_MAX), _FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def fp8_cache_dot_dtype(q_dtype: torch.dtype) -> tl.dtype:
    """What the attention kernels widen an FP8 cache's tiles (and q) to for their dots: fp16 for 16-bit queries
    (every e4m3 value is exact in fp16, and e4m3 -> fp16 is one instruction per pair of values on sm89+, where
    bf16 takes a detour through fp16 and fp32), fp32 for fp32 queries. TANDEM_KV_FP8_DOT=bf16 (read per call)
    keeps bf16 instead, for measuring the difference."""
    if q_dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if os.environ.get("TANDEM_KV_FP8_DOT") == "bf16" else tl.float16


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, USE_PDL: tl.constexpr, KV_FP8: tl.constexpr,
):
    # One program per token: copies the [num_kv_heads, head_dim] rows of K and V.
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    page = slot // PAGE
    in_page = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    dst = page * stride_kcb + in_page * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    tl.store(k_cache_ptr + dst, to_cache(k, k_cache_ptr, KV_FP8), mask=mask)

    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    dst = page * stride_vcb + in_page * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    tl.store(v_cache_ptr + dst, to_cache(v, v_cache_ptr, KV_FP8), mask=mask)


def write_kv_triton(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [>= num_tokens] int64 (or int32); -1 = skip; extra entries ignored
) -> None:
    """Write token t's K/V rows at flat slot slot_mapping[t] of the caches (any strides allowed)."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != k's {(num_kv_heads, head_dim)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping must be 1-D with >= {num_tokens} entries, got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    pdl = use_pdl(k.device)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        PAGE=k_cache.shape[1], USE_PDL=pdl, KV_FP8=is_fp8_cache(k_cache),
        num_warps=4 if block_h * block_d >= 1024 else 2, launch_pdl=bool(pdl),
    )
