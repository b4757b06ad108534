"""Batched LoRA for a decode step's tokens grouped by adapter slot: one kernel a step groups the token index
(`group_token_slots_triton`: a stable counting sort, each slot's rows cut into chunks of up to SORTED_CHUNK), then
every projection's shrink and expand give a program one chunk, gathering only its rows, where the one-block kernels
of triton_lora masked a whole step's tile down to each slot's rows in every program. The gate/up projection's expand
also applies silu(gate) * up (`lora_expand_gated_sorted_triton`): its programs take the chunks of the tokens without
an adapter too, so one kernel replaces the expand and the silu_and_mul after it. Graph-safe: static shapes, no host
sync; the grid holds the most chunks the step's tokens can make, and programs past the step's chunks find an empty
one and read and write nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.lora import MAX_RANK_TILES, SORTED_CHUNK, SlotGroups
from tandem.kernels.triton_launch import device_sms, pdl_wait, use_pdl


@triton.jit
def _group_kernel(src_ptr, slots_ptr, rows_ptr, chunk_ptr, N, NUM_SLOTS, MAX_CHUNKS, BLOCK_T: tl.constexpr,
                  SLOTS_P2: tl.constexpr, CHUNKS_P2: tl.constexpr, CHUNK: tl.constexpr):
    # One program. Copies the step's N slots (src) into the static index, then sorts the tokens by key (the slot;
    # NUM_SLOTS for none or out of range), stably: a token's place is the count of tokens before it in that
    # order, from a [BLOCK_T, BLOCK_T] comparison, so rows is a permutation of 0..N-1. Each key in use's rows are
    # cut into chunks of up to CHUNK; chunk [MAX_CHUNKS, 3] gets (slot, start, end) of the p-th chunk (slots
    # ascending, then those without an adapter as slot -1) at row p, (0, 0, 0) on the rows past the last.
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
    count = tl.where(ids <= NUM_SLOTS, count, 0)
    chunks = (count + CHUNK - 1) // CHUNK
    first = tl.cumsum(chunks, axis=0) - chunks  # a slot's first chunk
    p = tl.arange(0, CHUNKS_P2)
    match = (p[:, None] >= first[None, :]) & (p[:, None] < first[None, :] + chunks[None, :])  # [chunk, slot]
    has = tl.sum(match.to(tl.int32), axis=1) > 0
    seg_start = tl.sum(tl.where(match, start[None, :], 0), axis=1)
    seg_end = seg_start + tl.sum(tl.where(match, count[None, :], 0), axis=1)
    c_start = seg_start + (p - tl.sum(tl.where(match, first[None, :], 0), axis=1)) * CHUNK
    c_end = tl.minimum(seg_end, c_start + CHUNK)
    row = p < MAX_CHUNKS
    slot = tl.sum(tl.where(match, ids[None, :], 0), axis=1)
    tl.store(chunk_ptr + p * 3, tl.where(slot == NUM_SLOTS, -1, slot), mask=row)
    tl.store(chunk_ptr + p * 3 + 1, tl.where(has, c_start, 0), mask=row)
    tl.store(chunk_ptr + p * 3 + 2, tl.where(has, c_end, 0), mask=row)


@triton.jit
def _chunk_all_rows(chunk_ptr, rows_ptr, M, BLOCK_M: tl.constexpr):
    # The program's chunk: its slot (-1: tokens without an adapter), its rows' token indices, which are real (in
    # the chunk, below M: a grouping made over more tokens than this projection's M rows leaves the rest out) and
    # whether it has any.
    p = tl.program_id(0)
    slot, start, end = tl.load(chunk_ptr + p * 3), tl.load(chunk_ptr + p * 3 + 1), tl.load(chunk_ptr + p * 3 + 2)
    idx = start + tl.arange(0, BLOCK_M)
    m = tl.load(rows_ptr + idx, mask=idx < end, other=M)
    return slot, m, m < M, start < end


@triton.jit
def _chunk_rows(chunk_ptr, rows_ptr, M, BLOCK_M: tl.constexpr):
    # As _chunk_all_rows, for the kernels that touch only rows with an adapter: a chunk without one has none.
    slot, m, real, busy = _chunk_all_rows(chunk_ptr, rows_ptr, M, BLOCK_M)
    return slot, m, real & (slot >= 0), busy & (slot >= 0)


@triton.jit
def _sorted_shrink_kernel(x_ptr, a_ptr, rows_ptr, chunk_ptr, part_ptr, out_ptr, count_ptr, M, K, R, K_PER_SPLIT,
                          stride_xm, stride_as, stride_ar, stride_ps, stride_om,
                          SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    # grid (chunk programs, rank tiles * SPLITS): out[t, r] = sum_k x[t, k] * A[slot, r, k] over the chunk's rows
    # (a program past the chunks reads and writes nothing). SPLITS > 1 spreads K over programs writing fp32
    # partial sums; the last of a (chunk, rank tile)'s programs to finish (an acq_rel counter, reset by it) adds
    # them in split order: the same bits on every run.
    r_tile = tl.program_id(1) // SPLITS
    split = tl.program_id(1) % SPLITS
    pdl_wait(USE_PDL)
    slot, m, mine, busy = _chunk_rows(chunk_ptr, rows_ptr, M, BLOCK_M)
    r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    k_end = tl.where(busy, tl.minimum(K, (split + 1) * K_PER_SPLIT), 0)
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
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
        if busy:
            counter = count_ptr + tl.program_id(0) * (tl.num_programs(1) // SPLITS) + r_tile
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:  # every split's partial sums are stored
                total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for j in range(0, SPLITS):
                    total += tl.load(part_ptr + j * stride_ps + m[:, None] * stride_om + r[None, :], mask=cells,
                                     other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + m[:, None] * stride_om + r[None, :], total, mask=cells)
                tl.atomic_xchg(counter, 0)


@triton.jit
def _sorted_expand_kernel(s_ptr, b_ptr, rows_ptr, chunk_ptr, y_ptr, M, N, R, stride_sm, stride_bs, stride_bn,
                          stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          USE_PDL: tl.constexpr):
    # grid (chunk programs, output tiles): y[t, n] += sum_r s[t, r] * B[slot, n, r] over the chunk's rows; each row
    # is in one chunk, so programs never write the same element; rows without an adapter keep y's bits.
    pdl_wait(USE_PDL)
    slot, m, mine, busy = _chunk_rows(chunk_ptr, rows_ptr, M, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + n[:, None].to(tl.int64) * stride_bn
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, tl.where(busy, R, 0), BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        s = tl.load(s_ptr + m[:, None] * stride_sm + r[None, :], mask=mine[:, None] & (r[None, :] < R), other=0.0)
        b = tl.load(b_rows + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
        delta += tl.dot(s.to(b.dtype), tl.trans(b))
    y_ptrs = y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :]
    mask = mine[:, None] & (n[None, :] < N)
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sorted_expand_gated_kernel(s_ptr, b_ptr, rows_ptr, chunk_ptr, y_ptr, out_ptr, M, INTER, R, UP_COL,
                                stride_sm, stride_bs, stride_bn, stride_ym, stride_om, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    # grid (chunk programs, output tiles of INTER): y [M, 2 * INTER] holds the base gate then up rows, s the shrink,
    # B [slots, 2 * INTER, rank columns]: gate rows read columns [0, R), up rows [UP_COL, UP_COL + R) (the pool's
    # two-part layout: R a part's columns, UP_COL = R, the rest zero; one part: R all, UP_COL 0).
    # out[t, n] = silu(g) * u with g = y[t, n] + delta, u = y[t, INTER + n] + delta, each rounded where the
    # expand stores y and silu_and_mul rounds: the bits of the two kernels. Chunks without an adapter (slot -1)
    # add no delta.
    pdl_wait(USE_PDL)
    slot, m, real, busy = _chunk_all_rows(chunk_ptr, rows_ptr, M, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = n < INTER
    b_gate = b_ptr + slot.to(tl.int64) * stride_bs + n[:, None].to(tl.int64) * stride_bn
    b_up = b_gate + INTER * stride_bn + UP_COL
    s_rows = s_ptr + m[:, None] * stride_sm
    d_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    d_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, tl.where(busy & (slot >= 0), R, 0), BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        s_mask = real[:, None] & (r[None, :] < R)
        b_mask = cols[:, None] & (r[None, :] < R)
        bg = tl.load(b_gate + r[None, :], mask=b_mask, other=0.0)
        bu = tl.load(b_up + r[None, :], mask=b_mask, other=0.0)
        sg = tl.load(s_rows + r[None, :], mask=s_mask, other=0.0)
        su = tl.load(s_rows + UP_COL + r[None, :], mask=s_mask, other=0.0)
        d_gate += tl.dot(sg.to(bg.dtype), tl.trans(bg))
        d_up += tl.dot(su.to(bu.dtype), tl.trans(bu))
    cells = real[:, None] & cols[None, :]
    y_rows = y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :]
    gate = tl.load(y_rows, mask=cells, other=0.0)
    up = tl.load(y_rows + INTER, mask=cells, other=0.0)
    g = (gate.to(tl.float32) + d_gate).to(gate.dtype).to(tl.float32)
    u = (up.to(tl.float32) + d_up).to(up.dtype).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)  # F.silu rounds before the multiply
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :], (silu * u).to(gate.dtype), mask=cells)


def group_token_slots_triton(step_slots: torch.Tensor, token_slots: torch.Tensor, groups: SlotGroups) -> None:
    """step_slots [n] into token_slots[:n], and the n tokens grouped by slot into groups (one kernel); sets
    groups.num_tokens."""
    n, max_chunks = step_slots.shape[0], groups.chunks.shape[0]
    if (n > groups.rows.shape[0] or n > token_slots.shape[0] or step_slots.stride(0) != 1
            or max_chunks < chunk_programs(n, groups.num_slots)):
        raise ValueError(f"group token slots: {n} tokens for index {tuple(token_slots.shape)}, rows "
                         f"{tuple(groups.rows.shape)}, {max_chunks} chunks")
    _group_kernel[(1,)](step_slots, token_slots, groups.rows, groups.chunks, n, groups.num_slots, max_chunks,
                        BLOCK_T=max(16, triton.next_power_of_2(n)),
                        SLOTS_P2=triton.next_power_of_2(groups.num_slots + 1),
                        CHUNKS_P2=triton.next_power_of_2(max_chunks), CHUNK=SORTED_CHUNK, num_warps=4)
    groups.num_tokens = n


def chunk_programs(num_tokens: int, num_slots: int) -> int:
    """The most chunks num_tokens grouped tokens make: a part chunk for each slot in use and for the tokens
    without an adapter, a whole one per SORTED_CHUNK tokens."""
    return min(num_tokens, num_slots + 1) + num_tokens // SORTED_CHUNK


def _programs(groups: SlotGroups, n: int, num_slots: int) -> int:
    """The chunk programs of a kernel over n rows: the chunks of the step's grouping (over at least n tokens)."""
    if groups.num_slots != num_slots or not 0 < n <= groups.num_tokens:
        raise ValueError(f"sorted lora: {n} rows, {num_slots} slots; grouping of {groups.num_tokens} tokens over "
                         f"{groups.num_slots} slots")
    return chunk_programs(groups.num_tokens, num_slots)


def _block_r(rank: int) -> int:
    return max(16, min(triton.next_power_of_2(rank), 64))


def lora_shrink_sorted_triton(x: torch.Tensor, a: torch.Tensor, groups: SlotGroups,
                              counters: torch.Tensor | None = None, block_k: int = 128, splits: int | None = None,
                              num_warps: int = 4) -> torch.Tensor:
    """[n, rank] fp32: x [n, in] @ A[slot]^T per token through the step's grouping (rows without an adapter left
    unwritten, as lora_shrink_block_triton's); counters: lora_counters(slots) (None: made here); splits: K splits
    (None: about two programs an SM over the slots the rows could use). block_k: alone on an H200 Llama-3-8B's
    down shrink ran 7.7 us at 512 against 8.0 at 128 (32 rows over 8 adapters), but beside the base GEMM the
    lora bench fell from 0.833x to 0.813x with it."""
    n, k = x.shape
    num_slots, rank = a.shape[0], a.shape[1]
    if a.shape[2] != k or a.stride(-1) != 1:
        raise ValueError(f"lora shrink: x {tuple(x.shape)}, a {tuple(a.shape)}")
    programs = _programs(groups, n, num_slots)
    shrink = torch.empty(n, rank, dtype=torch.float32, device=x.device)  # [n, rank]
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_r = _block_r(rank)
    r_tiles = triton.cdiv(rank, block_r)
    if r_tiles > MAX_RANK_TILES:
        raise ValueError(f"lora rank columns {rank} exceed {MAX_RANK_TILES * block_r}")
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    k_tiles = triton.cdiv(k, block_k)
    if splits is None:  # a few slots alone would leave most SMs idle
        splits = triton.cdiv(2 * device_sms(x.device), min(n, num_slots) * r_tiles)
    splits = max(1, min(splits, k_tiles, 16))
    k_per_split = triton.cdiv(k_tiles, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    parts = torch.empty(splits, n, rank, dtype=torch.float32, device=x.device) if splits > 1 else shrink
    if counters is None or counters.numel() < programs * r_tiles:
        counters = torch.zeros(programs * r_tiles, dtype=torch.int32, device=x.device)
    pdl = use_pdl(x.device)
    _sorted_shrink_kernel[(programs, r_tiles * splits)](
        x, a, groups.rows, groups.chunks, parts, shrink, counters, n, k, rank, k_per_split, x.stride(0),
        a.stride(0), a.stride(1), parts.stride(0) if splits > 1 else 0, shrink.stride(0), SPLITS=splits,
        BLOCK_M=SORTED_CHUNK, BLOCK_R=block_r, BLOCK_K=block_k, USE_PDL=pdl, launch_pdl=bool(pdl),
        num_warps=num_warps)
    return shrink


def lora_expand_sorted_triton(y: torch.Tensor, shrink: torch.Tensor, b: torch.Tensor, groups: SlotGroups,
                              block_n: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """y [n, out] += shrink [n, rank] fp32 through each token's B [slots, out, rank], in place, through the step's
    grouping; rows without an adapter keep y's bits. block_n: output columns a program (None: 64 to 256, about
    four programs an SM over the slots the rows could use)."""
    n, rank = shrink.shape
    num_slots, out = b.shape[0], b.shape[1]
    if b.shape[2] != rank or y.shape != (n, out) or y.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"lora expand: shrink {tuple(shrink.shape)}, b {tuple(b.shape)}, y {tuple(y.shape)}")
    programs = _programs(groups, n, num_slots)
    if block_n is None:  # wide tiles, but enough of them to keep every SM streaming B
        wide = triton.next_power_of_2(triton.cdiv(min(n, num_slots) * out, 4 * device_sms(y.device)))
        block_n = min(256, max(64, wide))
    block_n = max(16, min(block_n, triton.next_power_of_2(out)))
    pdl = use_pdl(y.device)
    _sorted_expand_kernel[(programs, triton.cdiv(out, block_n))](
        shrink, b, groups.rows, groups.chunks, y, n, out, rank, shrink.stride(0), b.stride(0), b.stride(1),
        y.stride(0), BLOCK_M=SORTED_CHUNK, BLOCK_N=block_n, BLOCK_R=_block_r(rank), USE_PDL=pdl,
        launch_pdl=bool(pdl), num_warps=num_warps)
    return y


def lora_expand_gated_sorted_triton(y: torch.Tensor, shrink: torch.Tensor, b: torch.Tensor, groups: SlotGroups,
                                    parts: int, block_n: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """silu(gate) * up [n, I] of a gate/up projection's base output y [n, 2 * I] (gate then up) plus each token's
    delta, shrink [n, cols] fp32 through each token's B [slots, 2 * I, cols], through the step's grouping: bitwise
    lora_expand_sorted_triton then silu_and_mul. parts 2: B in the pool's layout of a merged gate/up projection
    (gate rows on the first half of the columns, up rows on the second, zero elsewhere: each reads its half);
    1: every row reads every column. block_n: as the expand's."""
    n, cols = shrink.shape
    num_slots, out = b.shape[0], b.shape[1]
    if (b.shape[2] != cols or parts not in (1, 2) or cols % parts or out % 2 or y.shape != (n, out)
            or y.stride(-1) != 1 or b.stride(-1) != 1):
        raise ValueError(f"lora gated expand: shrink {tuple(shrink.shape)}, b {tuple(b.shape)}, y {tuple(y.shape)}, "
                         f"{parts} parts")
    inter, rank = out // 2, cols // parts
    programs = _programs(groups, n, num_slots)
    if block_n is None:  # two B tiles and two y tiles a program: half the expand's widest tile
        wide = triton.next_power_of_2(triton.cdiv(min(n, num_slots) * inter, 4 * device_sms(y.device)))
        block_n = min(128, max(64, wide))
    block_n = max(16, min(block_n, triton.next_power_of_2(inter)))
    result = torch.empty(n, inter, dtype=y.dtype, device=y.device)
    pdl = use_pdl(y.device)
    _sorted_expand_gated_kernel[(programs, triton.cdiv(inter, block_n))](
        shrink, b, groups.rows, groups.chunks, y, result, n, inter, rank, rank if parts == 2 else 0,
        shrink.stride(0), b.stride(0),
        b.stride(1), y.stride(0), result.stride(0), BLOCK_M=SORTED_CHUNK, BLOCK_N=block_n, BLOCK_R=_block_r(rank),
        USE_PDL=pdl, launch_pdl=bool(pdl), num_warps=num_warps)
    return result
