"""Batched LoRA in the style of Punica's SGMV: shrink x @ A[slot]^T into fp32 rank columns, then expand them through
B[slot] and add onto the base projection's output. A program takes a token block and one of the adapter slots the
block uses (found on the GPU from the per-token slot index: no host-side sort), and multiplies that slot's tokens
as one tile product, so each adapter's A and B tiles are read once a block. The index is static, so a captured
graph serves any mix of adapters."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.lora import MAX_RANK_TILES, lora_counters
from tandem.kernels.triton_launch import pdl_wait, use_pdl


@triton.jit
def _block_slots(slots_ptr, M, BLOCK_M: tl.constexpr, SLOTS_P2: tl.constexpr):
    # The program's token block (grid axis 0): its rows, each row's slot (-1: none or past M), which slots the
    # block uses ([SLOTS_P2] 0/1), their running count (the n-th used slot has count n) and how many it uses.
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + m, mask=m < M, other=-1)
    ids = tl.arange(0, SLOTS_P2)
    used = tl.max((slots[:, None] == ids[None, :]).to(tl.int32), axis=0)
    return m, slots, used, tl.cumsum(used, axis=0), tl.sum(used, axis=0)


@triton.jit
def _nth_slot(used, running, nth, SLOTS_P2: tl.constexpr):
    # The block's nth used slot (from 0).
    return tl.sum(tl.where((used > 0) & (running == nth + 1), tl.arange(0, SLOTS_P2), 0), axis=0)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, part_ptr, out_ptr, count_ptr, M, K, R, K_PER_SPLIT,
                   stride_xm, stride_as, stride_ar, stride_ps, stride_om,
                   SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   SLOTS_P2: tl.constexpr, USE_PDL: tl.constexpr):
    # grid (token blocks, slot programs, rank tiles * SPLITS): out[t, r] = sum_k x[t, k] * A[slot, r, k]. Slot
    # program j takes the block's used slots j, j + J, ... (J of them: one each in a decode step, whose tokens
    # are one block; a prefill block nearly always uses one), each as one tile product over its tokens, so an
    # adapter's A is read once a block. SPLITS > 1 (decode) spreads K over programs that write fp32 partial sums;
    # the last of a (slot, rank tile)'s programs to finish (an acq_rel counter, reset by it) adds them in split
    # order: the same bits on every run, and the expand reads finished rank columns.
    r_tile = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    pdl_wait(USE_PDL)
    m, slots, used, running, count = _block_slots(slots_ptr, M, BLOCK_M, SLOTS_P2)
    r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    k_end = tl.minimum(K, (split + 1) * K_PER_SPLIT)
    for nth in range(tl.program_id(1), count, tl.num_programs(1)):
        slot = _nth_slot(used, running, nth, SLOTS_P2)
        mine = slots == slot
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(split * K_PER_SPLIT, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                         mask=mine[:, None] & (k[None, :] < k_end), other=0.0)
            ak = tl.load(a_rows + k[None, :], mask=(r[:, None] < R) & (k[None, :] < k_end), other=0.0)
            acc += tl.dot(xk, tl.trans(ak.to(xk.dtype)))
        rows = mine[:, None] & (r[None, :] < R)
        if SPLITS == 1:
            tl.store(out_ptr + m[:, None] * stride_om + r[None, :], acc, mask=rows)
        else:
            tl.store(part_ptr + split * stride_ps + m[:, None] * stride_om + r[None, :], acc, mask=rows)
            counter = count_ptr + slot * (tl.num_programs(2) // SPLITS) + r_tile
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:  # every split's partial sums are stored
                total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for j in range(0, SPLITS):
                    total += tl.load(part_ptr + j * stride_ps + m[:, None] * stride_om + r[None, :], mask=rows,
                                     other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + m[:, None] * stride_om + r[None, :], total, mask=rows)
                tl.atomic_xchg(counter, 0)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, slots_ptr, y_ptr, M, N, R, stride_sm, stride_bs, stride_bn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS_P2: tl.constexpr,
                   USE_PDL: tl.constexpr):
    # grid (token blocks, slot programs, output tiles): y[t, n] += sum_r s[t, r] * B[slot, n, r] for the tokens of
    # the program's used slots (as in the shrink); each slot's rows are its own, so programs never write the
    # same element; tokens without an adapter keep y's bits.
    pdl_wait(USE_PDL)
    m, slots, used, running, count = _block_slots(slots_ptr, M, BLOCK_M, SLOTS_P2)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    for nth in range(tl.program_id(1), count, tl.num_programs(1)):
        slot = _nth_slot(used, running, nth, SLOTS_P2)
        mine = slots == slot
        b_rows = b_ptr + slot.to(tl.int64) * stride_bs + n[:, None] * stride_bn
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            s = tl.load(s_ptr + m[:, None] * stride_sm + r[None, :], mask=mine[:, None] & (r[None, :] < R),
                        other=0.0)
            b = tl.load(b_rows + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
            delta += tl.dot(s.to(b.dtype), tl.trans(b))
        y_ptrs = y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :]
        mask = mine[:, None] & (n[None, :] < N)
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lora_tile_delta(slots, offs_m, offs_n, n_mask, ls_ptr, lb_ptr, R, stride_lsm, stride_lbs, stride_lbn,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS_P2: tl.constexpr):
    # The LoRA delta of a tile GEMM's [BLOCK_N channels, BLOCK_M rows] tile (the swap-AB layout), fp32: for each
    # adapter slot the rows use, B[slot]'s channel rows times the shrink of that slot's rows, as one tile product
    # (s at ls_ptr [M, R] fp32, rounded to B's dtype as the expand kernel rounds it). Rows with slot -1 (or past M,
    # whose slots the caller loads as -1) get exactly 0.
    ids = tl.arange(0, SLOTS_P2)
    used = tl.max((slots[:, None] == ids[None, :]).to(tl.int32), axis=0)
    running = tl.cumsum(used, axis=0)
    delta = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for nth in range(0, tl.sum(used, axis=0)):
        slot = _nth_slot(used, running, nth, SLOTS_P2)
        mine = slots == slot
        b_rows = lb_ptr + slot.to(tl.int64) * stride_lbs + offs_n[:, None].to(tl.int64) * stride_lbn
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            s = tl.load(ls_ptr + offs_m[:, None] * stride_lsm + r[None, :], mask=mine[:, None] & (r[None, :] < R),
                        other=0.0)
            b = tl.load(b_rows + r[None, :], mask=n_mask[:, None] & (r[None, :] < R), other=0.0)
            delta = tl.dot(b, tl.trans(s.to(b.dtype)), delta)
    return delta


# Up to this many tokens (decode steps) one token block holds them all and the shrink splits K; past it, blocks of
# PREFILL_BLOCK_M tokens (prefill chunks, whose rows nearly always share their request's adapter).
ONE_BLOCK_MAX = 128
PREFILL_BLOCK_M = 64


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    token_slots: torch.Tensor, counters: torch.Tensor | None = None, block_k: int = 128,
                    block_n: int | None = None, block_m: int | None = None, splits: int | None = None
                    ) -> torch.Tensor:
    """y [n, out] += per-token delta in place; x [n, in], a [slots, rank, in], b [slots, out, rank] (unit last
    strides), token_slots [n] int (-1: none); counters: lora_counters(slots) (None: made here). The rank columns
    stay fp32 between the two kernels. block_m: tokens a block (None: all up to ONE_BLOCK_MAX, else
    PREFILL_BLOCK_M); splits: K splits of a one-block shrink (None: about two programs an SM per slot in use);
    block_n: the expand's output tile (None: 64 to 256, by the programs the step's shape makes)."""
    n, k = x.shape
    num_slots, rank, out = a.shape[0], a.shape[1], b.shape[1]
    if a.shape[2] != k or b.shape[2] != rank or y.shape != (n, out) or token_slots.shape[0] < n:
        raise ValueError(f"lora shapes: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"y {tuple(y.shape)}, slots {tuple(token_slots.shape)}")
    if n == 0:
        return y
    shrink = lora_shrink_block_triton(x, a, token_slots, counters, block_k, block_m, splits)
    return lora_expand_triton(y, shrink, b, token_slots, block_n, block_m)


def lora_expand_triton(y: torch.Tensor, shrink: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                       block_n: int | None = None, block_m: int | None = None) -> torch.Tensor:
    """y [n, out] += shrink [n, rank] fp32 (lora_shrink_block_triton's, made with the same block_m) through each
    token's B [slots, out, rank], in place; rows with slot -1 keep y's bits."""
    n, rank = shrink.shape
    num_slots, out = b.shape[0], b.shape[1]
    if b.shape[2] != rank or y.shape != (n, out) or token_slots.shape[0] < n:
        raise ValueError(f"lora expand: shrink {tuple(shrink.shape)}, b {tuple(b.shape)}, y {tuple(y.shape)}, "
                         f"slots {tuple(token_slots.shape)}")
    if n == 0:
        return y
    assert y.stride(-1) == 1 and b.stride(-1) == 1
    block_m = _block_m(n, block_m)
    blocks = triton.cdiv(n, block_m)
    slot_programs = min(n, num_slots) if blocks == 1 else 1
    block_r = _block_r(rank)
    if block_n is None:  # wider output tiles where many slot programs would each pay a tile's fixed cost
        programs = blocks * slot_programs * out
        block_n = min(256, max(64, triton.next_power_of_2(triton.cdiv(programs, 8 * _num_sms(y.device)))))
    block_n = max(16, min(block_n, triton.next_power_of_2(out)))
    pdl = use_pdl(y.device)
    _expand_kernel[(blocks, slot_programs, triton.cdiv(out, block_n))](
        shrink, b, token_slots, y, n, out, rank, shrink.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, SLOTS_P2=slots_p2(num_slots), USE_PDL=pdl,
        launch_pdl=bool(pdl), num_warps=8 if block_m >= 64 else 4)
    return y


def lora_shrink_block_triton(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                             counters: torch.Tensor | None = None, block_k: int = 128, block_m: int | None = None,
                             splits: int | None = None) -> torch.Tensor:
    """[n, rank] fp32: x [n, in] @ A[slot]^T per token (rows with slot -1 left unwritten), by token blocks and the
    adapters each block uses (see lora_add_triton for the arguments): the shrink kernel alone, for a GEMM that adds
    the expand in its epilogue (triton_quant.skinny_matmul_triton's lora)."""
    n, k = x.shape
    num_slots, rank = a.shape[0], a.shape[1]
    if a.shape[2] != k or token_slots.shape[0] < n or a.stride(-1) != 1:
        raise ValueError(f"lora shrink: x {tuple(x.shape)}, a {tuple(a.shape)}, slots {tuple(token_slots.shape)}")
    shrink = torch.empty(n, rank, dtype=torch.float32, device=x.device)  # [n, rank]
    if n == 0:
        return shrink
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m = _block_m(n, block_m)
    blocks = triton.cdiv(n, block_m)
    block_r = _block_r(rank)
    r_tiles = triton.cdiv(rank, block_r)
    if r_tiles > MAX_RANK_TILES:
        raise ValueError(f"lora rank columns {rank} exceed {MAX_RANK_TILES * block_r}")
    block_k = max(16, min(block_k, triton.next_power_of_2(k), 8192 // block_m))
    k_tiles = triton.cdiv(k, block_k)
    if blocks > 1:
        splits = 1
    elif splits is None:  # one slot per token at most: a few tokens alone would leave most SMs idle
        splits = max(1, min(k_tiles, 16, triton.cdiv(2 * _num_sms(x.device), min(num_slots, n) * r_tiles)))
    k_per_split = triton.cdiv(k_tiles, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    parts = torch.empty(splits, n, rank, dtype=torch.float32, device=x.device) if splits > 1 else shrink
    if counters is None or counters.numel() < num_slots * MAX_RANK_TILES:
        counters = lora_counters(num_slots, x.device)
    pdl = use_pdl(x.device)
    # A program per used slot in a one-block (decode) step: up to min(tokens, slots) of them; a prefill block
    # loops over its few.
    slot_programs = min(n, num_slots) if blocks == 1 else 1
    _shrink_kernel[(blocks, slot_programs, r_tiles * splits)](
        x, a, token_slots, parts, shrink, counters, n, k, rank, k_per_split, x.stride(0), a.stride(0), a.stride(1),
        parts.stride(0) if splits > 1 else 0, shrink.stride(0), SPLITS=splits, BLOCK_M=block_m, BLOCK_R=block_r,
        BLOCK_K=block_k, SLOTS_P2=slots_p2(num_slots), USE_PDL=pdl, launch_pdl=bool(pdl))
    return shrink


def _block_m(n: int, block_m: int | None) -> int:
    if block_m is not None:
        return block_m
    return max(16, triton.next_power_of_2(n)) if n <= ONE_BLOCK_MAX else PREFILL_BLOCK_M


def _block_r(rank: int) -> int:
    return max(16, min(triton.next_power_of_2(rank), 64))


def slots_p2(num_slots: int) -> int:
    """The kernels' SLOTS_P2 for a pool of num_slots slots: the power of two the used-slot masks span."""
    return max(2, triton.next_power_of_2(num_slots))


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
