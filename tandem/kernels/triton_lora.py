"""Batched LoRA in the style of Punica's BGMV: per token, shrink x @ A[slot]^T into fp32 rank columns, then expand
them through B[slot] and add onto the base projection's output. Each program reads its token's slot from the
static per-token index, so a captured graph serves any mix of adapters."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_row(x_ptr, a_ptr, t, slot, r, R, k_start, k_end, stride_xm, stride_as, stride_ar,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # One token's rank columns over k in [k_start, k_end): sum_k x[t, k] * A[slot, r, k], in fp32.
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_xm + k, mask=k < k_end, other=0.0).to(tl.float32)
        ak = tl.load(a_rows + k[None, :], mask=(r[:, None] < R) & (k[None, :] < k_end), other=0.0).to(tl.float32)
        acc += tl.sum(ak * xk[None, :], axis=1)
    return acc


@triton.jit
def _expand_row(s, b_ptr, y_ptr, t, slot, n, r, N, R, stride_bs, stride_bn, stride_ym):
    # One token's y[t, n] += sum_r s[r] * B[slot, n, r] (s: its fp32 rank columns).
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + n[:, None] * stride_bn + r[None, :],
                mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
    y_ptrs = y_ptr + t * stride_ym + n
    y = tl.load(y_ptrs, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + tl.sum(b * s[None, :], axis=1)).to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, K, R, K_PER_SPLIT,
                   stride_xm, stride_as, stride_ar, stride_os, stride_om,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid (tokens, rank tiles, K splits): out[split, t, r] = sum over the split's k of x[t, k] * A[slot[t], r, k]
    # (a few tokens alone would leave most SMs idle: the splits spread one token's K over several programs).
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(2)
    k_end = tl.minimum(K, (split + 1) * K_PER_SPLIT)
    acc = _shrink_row(x_ptr, a_ptr, t, slot, r, R, split * K_PER_SPLIT, k_end, stride_xm, stride_as, stride_ar,
                      BLOCK_R, BLOCK_K)
    tl.store(out_ptr + split * stride_os + t * stride_om + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, slots_ptr, y_ptr, N, R, SPLITS,
                   stride_ss, stride_sm, stride_bs, stride_bn, stride_ym,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # grid (tokens, output tiles): y[t, n] += sum_r s[t, r] * B[slot[t], n, r], s summed over the shrink's K splits;
    # tokens without an adapter untouched
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    s = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for j in range(0, SPLITS):
        s += tl.load(s_ptr + j * stride_ss + t * stride_sm + r, mask=r < R, other=0.0)
    _expand_row(s, b_ptr, y_ptr, t, slot, n, r, N, R, stride_bs, stride_bn, stride_ym)


@triton.jit
def _block_slots(slots_ptr, M, BLOCK_M: tl.constexpr):
    # The program's token block: its rows, and the lowest and highest slot among its tokens (-1: no adapter at all;
    # low == top: one adapter for the whole block).
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + m, mask=m < M, other=-1)
    top = tl.max(slots, axis=0)
    low = tl.min(tl.where(m < M, slots, top), axis=0)
    return m, low, top


@triton.jit
def _shrink_block_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, M, K, R,
                         stride_xm, stride_as, stride_ar, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid (token blocks, rank tiles). A block whose tokens share one adapter (a prefill chunk's, nearly always) is
    # one tile product over K; a block that mixes adapters runs its rows one by one.
    m, low, top = _block_slots(slots_ptr, M, BLOCK_M)
    if top < 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    if low == top:
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        a_rows = a_ptr + top.to(tl.int64) * stride_as + r[:, None] * stride_ar
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                         other=0.0)
            ak = tl.load(a_rows + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)
            acc += tl.dot(xk, tl.trans(ak.to(xk.dtype)))
        tl.store(out_ptr + m[:, None] * stride_om + r[None, :], acc, mask=(m[:, None] < M) & (r[None, :] < R))
    else:
        for i in range(0, BLOCK_M):
            t = tl.program_id(0) * BLOCK_M + i
            slot = tl.load(slots_ptr + t, mask=t < M, other=-1)
            if slot >= 0:
                acc1 = _shrink_row(x_ptr, a_ptr, t, slot, r, R, 0, K, stride_xm, stride_as, stride_ar, BLOCK_R,
                                   BLOCK_K)
                tl.store(out_ptr + t * stride_om + r, acc1, mask=r < R)


@triton.jit
def _expand_block_kernel(s_ptr, b_ptr, slots_ptr, y_ptr, M, N, R,
                         stride_sm, stride_bs, stride_bn, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # grid (token blocks, output tiles): as _shrink_block_kernel, onto y in place; rows without an adapter untouched.
    m, low, top = _block_slots(slots_ptr, M, BLOCK_M)
    if top < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    if low == top:
        b = tl.load(b_ptr + top.to(tl.int64) * stride_bs + n[:, None] * stride_bn + r[None, :],
                    mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
        s = tl.load(s_ptr + m[:, None] * stride_sm + r[None, :], mask=(m[:, None] < M) & (r[None, :] < R), other=0.0)
        delta = tl.dot(s.to(b.dtype), tl.trans(b))  # [BLOCK_M, BLOCK_N] fp32
        y_ptrs = y_ptr + m[:, None] * stride_ym + n[None, :]
        mask = (m[:, None] < M) & (n[None, :] < N)
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        for i in range(0, BLOCK_M):
            t = tl.program_id(0) * BLOCK_M + i
            slot = tl.load(slots_ptr + t, mask=t < M, other=-1)
            if slot >= 0:
                s1 = tl.load(s_ptr + t * stride_sm + r, mask=r < R, other=0.0).to(tl.float32)
                _expand_row(s1, b_ptr, y_ptr, t, slot, n, r, N, R, stride_bs, stride_bn, stride_ym)


# Up to this many tokens (decode steps, whose rows mix adapters) one program takes one token; past it, blocks of
# BLOCK_M tokens (prefill chunks, whose rows share their request's adapter) take tile products.
PER_TOKEN_MAX = 128


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    token_slots: torch.Tensor, block_k: int = 256, block_n: int = 64,
                    block_m: int | None = None, splits: int | None = None) -> torch.Tensor:
    """y [n, out] += per-token delta in place; x [n, in], a [slots, rank, in], b [slots, out, rank] (unit last
    strides), token_slots [n] int (-1: none). The rank columns stay fp32 between the two kernels. block_m: tokens
    a program takes (1: one each; None: by the token count, PER_TOKEN_MAX); splits: K splits of the per-token shrink
    (None: enough programs for about two an SM)."""
    n, k = x.shape
    rank, out = a.shape[1], b.shape[1]
    if a.shape[2] != k or b.shape[2] != rank or y.shape != (n, out) or token_slots.shape[0] < n:
        raise ValueError(f"lora shapes: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"y {tuple(y.shape)}, slots {tuple(token_slots.shape)}")
    if n == 0:
        return y
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert y.stride(-1) == 1 and a.stride(-1) == 1 and b.stride(-1) == 1
    if block_m is None:
        block_m = 1 if n <= PER_TOKEN_MAX else 32
    if block_m > 1:
        shrink = torch.empty(n, rank, dtype=torch.float32, device=x.device)  # [n, rank]
        full_r = max(16, triton.next_power_of_2(rank))
        block_k = max(16, min(block_k // 4, triton.next_power_of_2(k)))
        _shrink_block_kernel[(triton.cdiv(n, block_m), 1)](
            x, a, token_slots, shrink, n, k, rank, x.stride(0), a.stride(0), a.stride(1), shrink.stride(0),
            BLOCK_M=block_m, BLOCK_R=full_r, BLOCK_K=block_k)
        block_n = max(16, min(block_n, triton.next_power_of_2(out)))
        _expand_block_kernel[(triton.cdiv(n, block_m), triton.cdiv(out, block_n))](
            shrink, b, token_slots, y, n, out, rank, shrink.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=full_r)
        return y
    block_r = min(triton.next_power_of_2(rank), 16)
    block_k = min(block_k, triton.next_power_of_2(k))
    r_tiles, k_tiles = triton.cdiv(rank, block_r), triton.cdiv(k, block_k)
    if splits is None:  # about two programs an SM
        splits = max(1, min(k_tiles, triton.cdiv(2 * _num_sms(x.device), n * r_tiles)))
    k_per_split = triton.cdiv(k_tiles, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    shrink = torch.empty(splits, n, rank, dtype=torch.float32, device=x.device)  # [splits, n, rank] partial sums
    _shrink_kernel[(n, r_tiles, splits)](
        x, a, token_slots, shrink, k, rank, k_per_split, x.stride(0), a.stride(0), a.stride(1), shrink.stride(0),
        shrink.stride(1), BLOCK_R=block_r, BLOCK_K=block_k)
    full_r = triton.next_power_of_2(rank)
    block_n = min(block_n, max(16, 4096 // full_r), triton.next_power_of_2(out))
    _expand_kernel[(n, triton.cdiv(out, block_n))](
        shrink, b, token_slots, y, out, rank, splits, shrink.stride(0), shrink.stride(1), b.stride(0), b.stride(1),
        y.stride(0), BLOCK_N=block_n, BLOCK_R=full_r)
    return y


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
