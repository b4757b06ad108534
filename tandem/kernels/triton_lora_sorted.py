"""Batched LoRA for a decode step's tokens grouped by adapter slot: one kernel a step groups the token index
(`group_token_slots`: a stable counting sort into the rows of each slot in use), then every projection's shrink and
expand give a program one slot in use and gather only that slot's rows, BLOCK_M at a time, where the one-block
kernels of triton_lora masked a whole step's tile down to each slot's rows. Graph-safe: static shapes, no host
sync; slot programs past the slots in use find an empty segment and do nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.lora import MAX_RANK_TILES, SlotGroups, lora_counters
from tandem.kernels.triton_launch import device_sms, pdl_wait, use_pdl

SORTED_BLOCK_M = 16  # rows a slot program takes at a time (a decode step's segments are mostly shorter)


@triton.jit
def _group_kernel(src_ptr, slots_ptr, rows_ptr, seg_ptr, N, NUM_SLOTS, BLOCK_T: tl.constexpr,
                  SLOTS_P2: tl.constexpr):
    # One program. Copies the step's N slots (src) into the static index, then sorts the tokens by key (the slot;
    # NUM_SLOTS for none or out of range), stably: a token's place is the count of tokens before it in that
    # order, from a [BLOCK_T, BLOCK_T] comparison, so rows is a permutation of 0..N-1. seg [NUM_SLOTS, 3] gets
    # (slot, start, end) of the p-th slot in use (ascending) at row p, (0, 0, 0) on the rows past the last.
    t = tl.arange(0, BLOCK_T)
    valid = t < N
    s = tl.load(src_ptr + t, mask=valid, other=-1)
    tl.store(slots_ptr + t, s, mask=valid)
    key = tl.where((s >= 0) & (s < NUM_SLOTS), s, NUM_SLOTS)
    key = tl.where(valid, key, NUM_SLOTS + 1)
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (t[None, :] < t[:, None]))
    tl.store(rows_ptr + tl.sum(before.to(tl.int32), axis=1), t, mask=valid)
    ids = tl.arange(0, SLOTS_P2)
    start = tl.sum((key[None, :] < ids[:, None]).to(tl.int32), axis=1)  # [SLOTS_P2]: tokens of smaller slots
    count = tl.sum((key[None, :] == ids[:, None]).to(tl.int32), axis=1)
    used = (count > 0) & (ids < NUM_SLOTS)
    nth = tl.cumsum(used.to(tl.int32), axis=0) - 1  # a used slot's place among the used
    match = used[None, :] & (nth[None, :] == ids[:, None])  # [p, slot]: slot is the p-th used
    seg_slot = tl.sum(tl.where(match, ids[None, :], 0), axis=1)
    seg_start = tl.sum(tl.where(match, start[None, :], 0), axis=1)
    seg_end = seg_start + tl.sum(tl.where(match, count[None, :], 0), axis=1)
    p = ids < NUM_SLOTS
    tl.store(seg_ptr + ids * 3, seg_slot, mask=p)
    tl.store(seg_ptr + ids * 3 + 1, seg_start, mask=p)
    tl.store(seg_ptr + ids * 3 + 2, seg_end, mask=p)


@triton.jit
def _segment(seg_ptr, p):
    # The p-th slot in use and its rows' span in the grouped rows (empty past the slots in use).
    return tl.load(seg_ptr + p * 3), tl.load(seg_ptr + p * 3 + 1), tl.load(seg_ptr + p * 3 + 2)


@triton.jit
def _segment_rows(rows_ptr, m0, end, M, BLOCK_M: tl.constexpr):
    # BLOCK_M grouped rows from m0: their token indices and which are real (in the segment, below M: a grouping
    # made over more tokens than this projection's M rows leaves the rest out).
    idx = m0 + tl.arange(0, BLOCK_M)
    m = tl.load(rows_ptr + idx, mask=idx < end, other=M)
    return m, m < M


@triton.jit
def _sorted_shrink_kernel(x_ptr, a_ptr, rows_ptr, seg_ptr, part_ptr, out_ptr, count_ptr, M, K, R, K_PER_SPLIT,
                          stride_xm, stride_as, stride_ar, stride_ps, stride_om,
                          SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    # grid (slot programs, rank tiles * SPLITS): out[t, r] = sum_k x[t, k] * A[slot, r, k] over the program's
    # slot's rows. SPLITS > 1 spreads K over programs writing fp32 partial sums; the last of a (slot, rank
    # tile)'s programs to finish (an acq_rel counter, reset by it) adds them in split order: the same bits on
    # every run.
    r_tile = tl.program_id(1) // SPLITS
    split = tl.program_id(1) % SPLITS
    pdl_wait(USE_PDL)
    slot, start, end = _segment(seg_ptr, tl.program_id(0))
    r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    k_end = tl.minimum(K, (split + 1) * K_PER_SPLIT)
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
    for m0 in range(start, end, BLOCK_M):
        m, mine = _segment_rows(rows_ptr, m0, end, M, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(split * K_PER_SPLIT, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                         mask=mine[:, None] & (k[None, :] < k_end), other=0.0)
            ak = tl.load(a_rows + k[None, :], mask=(r[:, None] < R) & (k[None, :] < k_end), other=0.0)
            acc += tl.dot(xk, tl.trans(ak.to(xk.dtype)))
        cells = mine[:, None] & (r[None, :] < R)
        if SPLITS == 1:
            tl.store(out_ptr + m[:, None] * stride_om + r[None, :], acc, mask=cells)
        else:
            tl.store(part_ptr + split * stride_ps + m[:, None] * stride_om + r[None, :], acc, mask=cells)
    if SPLITS > 1:
        if start < end:
            counter = count_ptr + slot * (tl.num_programs(1) // SPLITS) + r_tile
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:  # every split's partial sums are stored
                for m0 in range(start, end, BLOCK_M):
                    m, mine = _segment_rows(rows_ptr, m0, end, M, BLOCK_M)
                    cells = mine[:, None] & (r[None, :] < R)
                    total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for j in range(0, SPLITS):
                        total += tl.load(part_ptr + j * stride_ps + m[:, None] * stride_om + r[None, :],
                                         mask=cells, other=0.0, cache_modifier=".cg")
                    tl.store(out_ptr + m[:, None] * stride_om + r[None, :], total, mask=cells)
                tl.atomic_xchg(counter, 0)


@triton.jit
def _sorted_expand_kernel(s_ptr, b_ptr, rows_ptr, seg_ptr, y_ptr, M, N, R, stride_sm, stride_bs, stride_bn,
                          stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          USE_PDL: tl.constexpr):
    # grid (slot programs, output tiles): y[t, n] += sum_r s[t, r] * B[slot, n, r] over the program's slot's rows;
    # each row belongs to one slot, so programs never write the same element; rows without an adapter keep y's
    # bits.
    pdl_wait(USE_PDL)
    slot, start, end = _segment(seg_ptr, tl.program_id(0))
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + n[:, None].to(tl.int64) * stride_bn
    for m0 in range(start, end, BLOCK_M):
        m, mine = _segment_rows(rows_ptr, m0, end, M, BLOCK_M)
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


def group_token_slots_triton(step_slots: torch.Tensor, token_slots: torch.Tensor, groups: SlotGroups) -> None:
    """step_slots [n] into token_slots[:n], and the n tokens grouped by slot into groups (one kernel)."""
    n, num_slots = step_slots.shape[0], groups.segments.shape[0]
    if n > groups.rows.shape[0] or n > token_slots.shape[0] or step_slots.stride(0) != 1:
        raise ValueError(f"group token slots: {n} tokens for index {tuple(token_slots.shape)}, rows "
                         f"{tuple(groups.rows.shape)}")
    _group_kernel[(1,)](step_slots, token_slots, groups.rows, groups.segments, n, num_slots,
                        BLOCK_T=max(16, triton.next_power_of_2(n)), SLOTS_P2=max(2, triton.next_power_of_2(num_slots)),
                        num_warps=4)


def _check(groups: SlotGroups, n: int, num_slots: int) -> None:
    if groups.segments.shape[0] != num_slots or n > groups.rows.shape[0]:
        raise ValueError(f"sorted lora: {n} rows, {num_slots} slots, groups of {tuple(groups.rows.shape)} rows "
                         f"and {groups.segments.shape[0]} slots")


def lora_shrink_sorted_triton(x: torch.Tensor, a: torch.Tensor, groups: SlotGroups,
                              counters: torch.Tensor | None = None, block_k: int = 128, splits: int | None = None,
                              num_warps: int = 4) -> torch.Tensor:
    """[n, rank] fp32: x [n, in] @ A[slot]^T per token through the grouped rows (rows without an adapter left
    unwritten, as lora_shrink_block_triton's); counters: lora_counters(slots) (None: made here); splits: K splits
    (None: about two programs an SM)."""
    n, k = x.shape
    num_slots, rank = a.shape[0], a.shape[1]
    if a.shape[2] != k or a.stride(-1) != 1:
        raise ValueError(f"lora shrink: x {tuple(x.shape)}, a {tuple(a.shape)}")
    _check(groups, n, num_slots)
    shrink = torch.empty(n, rank, dtype=torch.float32, device=x.device)  # [n, rank]
    if n == 0:
        return shrink
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_r = max(16, min(triton.next_power_of_2(rank), 64))
    r_tiles = triton.cdiv(rank, block_r)
    if r_tiles > MAX_RANK_TILES:
        raise ValueError(f"lora rank columns {rank} exceed {MAX_RANK_TILES * block_r}")
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    k_tiles = triton.cdiv(k, block_k)
    slot_programs = min(n, num_slots)
    if splits is None:  # a few slots alone would leave most SMs idle
        splits = triton.cdiv(2 * device_sms(x.device), slot_programs * r_tiles)
    splits = max(1, min(splits, k_tiles, 16))
    k_per_split = triton.cdiv(k_tiles, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    parts = torch.empty(splits, n, rank, dtype=torch.float32, device=x.device) if splits > 1 else shrink
    if counters is None or counters.numel() < num_slots * MAX_RANK_TILES:
        counters = lora_counters(num_slots, x.device)
    pdl = use_pdl(x.device)
    _sorted_shrink_kernel[(slot_programs, r_tiles * splits)](
        x, a, groups.rows, groups.segments, parts, shrink, counters, n, k, rank, k_per_split, x.stride(0),
        a.stride(0), a.stride(1), parts.stride(0) if splits > 1 else 0, shrink.stride(0), SPLITS=splits,
        BLOCK_M=SORTED_BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k, USE_PDL=pdl, launch_pdl=bool(pdl),
        num_warps=num_warps)
    return shrink


def lora_expand_sorted_triton(y: torch.Tensor, shrink: torch.Tensor, b: torch.Tensor, groups: SlotGroups,
                              block_n: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """y [n, out] += shrink [n, rank] fp32 through each token's B [slots, out, rank], in place, through the grouped
    rows; rows without an adapter keep y's bits. block_n: output columns a program (None: 64 to 256, about four
    programs an SM)."""
    n, rank = shrink.shape
    num_slots, out = b.shape[0], b.shape[1]
    if b.shape[2] != rank or y.shape != (n, out) or y.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"lora expand: shrink {tuple(shrink.shape)}, b {tuple(b.shape)}, y {tuple(y.shape)}")
    _check(groups, n, num_slots)
    if n == 0:
        return y
    slot_programs = min(n, num_slots)
    if block_n is None:  # wide tiles, but enough of them to keep every SM streaming B
        block_n = min(256, max(64, triton.next_power_of_2(triton.cdiv(slot_programs * out, 4 * device_sms(y.device)))))
    block_n = max(16, min(block_n, triton.next_power_of_2(out)))
    pdl = use_pdl(y.device)
    _sorted_expand_kernel[(slot_programs, triton.cdiv(out, block_n))](
        shrink, b, groups.rows, groups.segments, y, n, out, rank, shrink.stride(0), b.stride(0), b.stride(1),
        y.stride(0), BLOCK_M=SORTED_BLOCK_M, BLOCK_N=block_n, BLOCK_R=max(16, min(triton.next_power_of_2(rank), 64)),
        USE_PDL=pdl, launch_pdl=bool(pdl), num_warps=num_warps)
    return y
