"""Triton paged attention over the block-table KV cache: split-KV decode and causal varlen prefill."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX
from tandem.kernels.reference import compute_dtype
from tandem.kernels.triton_kv import fp8_cache_dot_dtype, is_fp8_cache, to_cache
from tandem.kernels.triton_launch import device_sms, pdl_wait, persistent_state, prefetch_l2, use_pdl
from tandem.kernels.triton_rotary_kv import check_rotary_args

LOG2E = 1.4426950408889634
# Each decode split reads at least this many KV tiles. A split's partial costs D + 1 fp32 written and read
# back by the reduce, against 2 * block_n * D cache elements per tile, so one tile already pays for it; and
# at batch 1 with a short context every split is a chain of dependent loads (block table, K, V), so more,
# shorter chains finish sooner. (It was 4: bs1 x 512 then ran 16 programs on 132 SMs.)
MIN_TILES_PER_SPLIT = 1
MAX_SPLITS = int(os.environ.get("TANDEM_DECODE_MAX_SPLITS", "32"))  # tuning runs may change it
# How many decode programs per SM one wave of splits aims at before splitting a sequence's KV further.
PROGRAMS_PER_SM = 4
# fp32 partial values the split merge loads a round: ~4K (32 registers a thread at 4 warps), or up to ~16K (one
# round for 32 splits of 4 heads of 128 dims) where the grid fits one wave even at the 3 programs an SM those
# registers leave room for (168 registers against 120 at 4K for the plain bf16 kernel, from ptxas).
MERGE_VALUES, MERGE_VALUES_ONE_WAVE = 4096, 16384


_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)

# ----------------------------------------------------------------------------- shared device helpers


@triton.jit
def _kv_tile_rows(bt_row_ptr, offs_n, n_mask, stride_b, stride_s, PAGE: tl.constexpr, MASKED: tl.constexpr):
    # Element offsets of context positions offs_n within one kv head of the cache, through the block table.
    if MASKED:
        pages = tl.load(bt_row_ptr + offs_n // PAGE, mask=n_mask, other=0)
    else:
        pages = tl.load(bt_row_ptr + offs_n // PAGE)
    return pages.to(tl.int64) * stride_b + (offs_n % PAGE) * stride_s


@triton.jit
def _load_rows(base_ptr, rows, offs_d, stride_d, row_mask, d_mask, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr):
    # A [rows, BLOCK_D] tile; masks are compile-time optional so unmasked tiles keep vectorized loads.
    ptrs = base_ptr + rows[:, None] + offs_d[None, :] * stride_d
    if MASK_ROWS:
        if MASK_D:
            tile = tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        if MASK_D:
            tile = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


# ----------------------------------------------------------------------------- decode


@triton.jit
def _rotate(x, xp, c, s, lower, norm_w, norm_w_partner, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    # Rows [R, BLOCK_D] of one token's q or k heads, (RMS-normalized per head and) rotated: dims d < HALF pair
    # with d + HALF (xp holds each dim's partner), the others with d - HALF. Rounds as torch's apply_rotary
    # in the storage dtype: each product, then the sum.
    dt = x.dtype
    f = x.to(tl.float32)
    fp = xp.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(f * f, axis=1) / HEAD_DIM + eps)[:, None]
        f = ((f * rstd).to(dt).to(tl.float32) * norm_w).to(dt).to(tl.float32)
        fp = ((fp * rstd).to(dt).to(tl.float32) * norm_w_partner).to(dt).to(tl.float32)
    fc = (f * c).to(dt).to(tl.float32)
    ps = (fp * s).to(dt).to(tl.float32)
    return tl.where(lower, fc - ps, fc + ps).to(dt)


@triton.jit
def _attend_tile(q, k, v, n_mask, m_i, l_i, acc, qk_scale, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 KV_FP8: tl.constexpr):
    # One KV tile of online softmax: scores in the log2 domain, running max m_i, sum l_i, output acc.
    # q [BLOCK_G, BLOCK_D]: tensor-core operand (USE_DOT), or one head (BLOCK_G 1) against k in fp32.
    # KV_FP8: the e4m3 tiles are widened to q's dtype (KV_DT, exactly), and the dots run in it.
    if KV_FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if USE_DOT:
        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION)
    else:
        s = tl.sum(tl.sum(q.to(tl.float32), axis=0)[None, :] * k.to(tl.float32), axis=1)[None, :]
    s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))  # [BLOCK_G, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every visited tile has a valid position
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        pv = tl.sum(tl.sum(p, axis=0)[:, None] * v.to(tl.float32), axis=0)[None, :]
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _store_heads(out_ptr, oscale_ptr, b, kvh, heads, offs_d, o, mask, stride_ob, stride_oh, stride_od,
                 KV_HEADS: tl.constexpr, FP8_OUT: tl.constexpr, dt: tl.constexpr):
    # One kv head's query heads of sequence b ([G, BLOCK_D] fp32). FP8_OUT: rounded to the model dtype dt, as
    # the output would be stored, then quantized as one group (quantize_activation_groups_ref: e4m3 values at
    # out_ptr, the group's scale at oscale_ptr[b, kvh]) for the FP8 o_proj after the attention.
    offs = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    if FP8_OUT:
        val = tl.where(mask, o.to(dt).to(tl.float32), 0.0)
        amax = tl.max(tl.max(tl.abs(val), axis=1), axis=0)
        # One IEEE division for the group, then a multiply per value (a division per value, as the per-token
        # quantizer does, made the batch-32 x 512 kernel 3 us slower on an H200, against 0.3 us for this).
        amax = tl.maximum(amax, _MIN_AMAX)
        inv = tl.math.div_rn(_FP8_MAX, amax)
        qv = tl.minimum(tl.maximum(val * inv, -_FP8_MAX), _FP8_MAX)
        tl.store(out_ptr + offs, qv.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(oscale_ptr + b * KV_HEADS + kvh, tl.math.div_rn(amax, _FP8_MAX))
    else:
        tl.store(out_ptr + offs, o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, order_ptr, out_ptr, oscale_ptr, ws_o_ptr, ws_lse_ptr, counts_ptr,
    new_k_ptr, new_v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr, eps,
    qk_scale, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_b, stride_s, stride_h, stride_d,  # shared by k_cache and v_cache
    stride_btb,
    stride_ob, stride_oh, stride_od,
    stride_nkb, stride_nkh, stride_nvb, stride_nvh, stride_cos, stride_sin,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT_OUT: tl.constexpr, USE_PDL: tl.constexpr,
    KV_HEADS: tl.constexpr, HAS_ORDER: tl.constexpr, ROTARY: tl.constexpr, HAS_NORM: tl.constexpr,
    LINES: tl.constexpr, FP8_OUT: tl.constexpr, KV_FP8: tl.constexpr, KV_DT: tl.constexpr,
    ONE_TILE_PROGRAMS: tl.constexpr,
):
    # Program (slot i x kv head, split): all GROUP query heads of one kv head of sequence b over one contiguous
    # share of its KV tiles. The share is computed from seq_len on the device, so every split gets work
    # whatever the sequence's length, and the grid (hence a CUDA graph) never depends on the data. With
    # HAS_ORDER, slot i is sequence order[i] (longest context first): the GPU starts programs in grid order,
    # so the long ones start early and the short ones fill the last wave instead of a long one running alone.
    #
    # ROTARY: q, k and v are this step's raw projections (q_ptr / new_k_ptr / new_v_ptr rows of the fused qkv
    # output). The program rotates (and with HAS_NORM first RMS-normalizes) its q heads and its kv head's new
    # k itself; the program whose share holds the new position (seq_len - 1) writes k and v into the cache
    # slot after its tiles, and every program takes the new k and v from registers (the tiles stop before the
    # new position), so no program reads what this launch writes.
    #
    # Under PDL the program reads its first KV tile before pdl_wait, so the context streams while the kernel
    # before it still runs: into registers with ROTARY (its predecessor is the qkv projection, and no kernel
    # of the step writes a cached position), else into L2 only (the rotary kernel before it writes the new
    # position). The rest of what it reads before the wait comes from the host before the step (block table,
    # seq_lens, order, slots) or is a weight (norms).
    #
    # Several splits: each writes its normalized partial and log-sum-exp, then counts itself in; the last of
    # a (sequence, kv head)'s non-empty splits to arrive merges all partials in split order (the same result
    # whichever program it is) and resets the count to 0 for the next launch.
    slot = tl.program_id(0) // KV_HEADS
    kvh = tl.program_id(0) % KV_HEADS
    split = tl.program_id(1)
    if HAS_ORDER:
        b = tl.load(order_ptr + slot)
    else:
        b = slot
    num_heads = KV_HEADS * GROUP

    seq_len = tl.load(seq_lens_ptr + b)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    # A constexpr budget over the grid's rows (batch x kv heads), not a per-batch argument: one compiled kernel
    # serves every batch size (an int argument would be specialized on its value: new compiles mid-run).
    one_tile_max = ONE_TILE_PROGRAMS // tl.num_programs(0)
    tiles_per_split = _split_tiles(num_tiles, num_splits, one_tile_max)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    mask = g_mask[:, None] & d_mask[None, :]
    if not DIRECT_OUT:
        if tile_lo >= num_tiles:
            if num_tiles == 0:
                if split == 0:  # seq_len 0 (a padding row): zeros, never NaN
                    pdl_wait(USE_PDL)
                    _store_heads(out_ptr, oscale_ptr, b, kvh, heads, offs_d, tl.zeros([BLOCK_G, BLOCK_D], tl.float32),
                                 mask, stride_ob, stride_oh, stride_od, KV_HEADS, FP8_OUT, q_ptr.dtype.element_ty)
            return  # an empty share: the merge reads only the splits that hold tiles (_used_splits)

    k_base = k_ptr + kvh * stride_h
    v_base = v_ptr + kvh * stride_h
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    # With ROTARY the tiles cover the context before the new position, which comes last, from registers.
    cached_len = seq_len - 1 if ROTARY else seq_len
    cached_hi = tl.minimum(tile_hi, tl.cdiv(cached_len, BLOCK_N))  # past the share's last cached tile
    # With ROTARY the share's first tile is loaded into registers before the wait. No kernel of the step
    # writes a cached position (this launch writes the new one, which no tile covers), so the tile is what
    # the wait would have shown. Without ROTARY the rotary kernel before this one writes the new position
    # into the cache, so under PDL the first tile is only prefetched into L2 (no value is read).
    offs_first = tile_lo * BLOCK_N + offs_n0
    first_mask = offs_first < tl.minimum(cached_len, tile_hi * BLOCK_N)
    first_rows = _kv_tile_rows(bt_row, offs_first, first_mask, stride_b, stride_s, PAGE, True)
    if ROTARY:
        k_first = _load_rows(k_base, first_rows, offs_d, stride_d, first_mask, d_mask, True, HEAD_DIM != BLOCK_D)
        v_first = _load_rows(v_base, first_rows, offs_d, stride_d, first_mask, d_mask, True, HEAD_DIM != BLOCK_D)
    elif USE_PDL:
        # The share's first KV tile into L2 while the kernels before this one finish: a prefetch changes no
        # value (L2 is where every write lands), so it may run before the wait on any address.
        offs_line = tl.arange(0, LINES) * (1024 // k_ptr.dtype.element_ty.primitive_bitwidth)  # a line apart
        lines = first_rows[:, None] + offs_line[None, :] * stride_d
        line_mask = first_mask[:, None] & (offs_line < HEAD_DIM)[None, :]
        prefetch_l2(k_base + lines, line_mask)
        prefetch_l2(v_base + lines, line_mask)
    if ROTARY:  # what comes from the host or the weights, before the wait
        HALF: tl.constexpr = HEAD_DIM // 2
        lower = (offs_d < HALF)[None, :]
        partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        last = seq_len - 1
        holds_new = (tile_lo * BLOCK_N <= last) & (last < tile_hi * BLOCK_N)  # this share holds the new position
        new_slot = tl.load(slot_ptr + b).to(tl.int64)
        qw = tl.zeros([1, BLOCK_D], tl.float32)  # placeholders without norm weights
        qwp = qw
        kw = qw
        kwp = qw
        if HAS_NORM:
            qw = tl.load(qw_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            qwp = tl.load(qw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            kw = tl.load(kw_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            kwp = tl.load(kw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    pdl_wait(USE_PDL)

    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    if ROTARY:
        c = tl.load(cos_ptr + b.to(tl.int64) * stride_cos + offs_d % HALF, mask=d_mask, other=0.0)
        s = tl.load(sin_ptr + b.to(tl.int64) * stride_sin + offs_d % HALF, mask=d_mask, other=0.0)
        c = c.to(tl.float32)[None, :]
        s = s.to(tl.float32)[None, :]
        q_raw = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=mask, other=0.0)
        q_par = tl.load(q_rows + partner[None, :] * stride_qd, mask=mask, other=0.0)
        k_row = new_k_ptr + b.to(tl.int64) * stride_nkb + kvh * stride_nkh
        k_raw = tl.load(k_row + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        k_par = tl.load(k_row + partner[None, :], mask=d_mask[None, :], other=0.0)
        new_v = tl.load(new_v_ptr + b.to(tl.int64) * stride_nvb + kvh * stride_nvh + offs_d[None, :],
                        mask=d_mask[None, :], other=0.0)
        new_v = to_cache(new_v, v_ptr, KV_FP8)  # [1, BLOCK_D], as the cache will hold it
        q = _rotate(q_raw, q_par, c, s, lower, qw, qwp, eps, HEAD_DIM, HAS_NORM)
    else:
        q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=mask, other=0.0)  # [BLOCK_G, BLOCK_D]

    if KV_FP8:  # the dots run in KV_DT (fp16 for 16-bit q: the e4m3 tiles widen to it in one step)
        q = q.to(KV_DT)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    tile_start = tile_lo
    if ROTARY:
        if tile_lo < cached_hi:
            m_i, l_i, acc = _attend_tile(q, k_first, v_first, first_mask, m_i, l_i, acc, qk_scale, USE_DOT,
                                         DOT_PRECISION, KV_FP8)
        tile_start = tile_lo + 1
    for tile in range(tile_start, cached_hi):
        offs_n = tile * BLOCK_N + offs_n0
        n_mask = offs_n < cached_len
        kv_rows = _kv_tile_rows(bt_row, offs_n, n_mask, stride_b, stride_s, PAGE, True)
        k = _load_rows(k_base, kv_rows, offs_d, stride_d, n_mask, d_mask, True, HEAD_DIM != BLOCK_D)
        v = _load_rows(v_base, kv_rows, offs_d, stride_d, n_mask, d_mask, True, HEAD_DIM != BLOCK_D)
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask, m_i, l_i, acc, qk_scale, USE_DOT, DOT_PRECISION, KV_FP8)
    if ROTARY:
        if holds_new:
            new_k = to_cache(_rotate(k_raw, k_par, c, s, lower, kw, kwp, eps, HEAD_DIM, HAS_NORM), k_ptr, KV_FP8)
            s_new = tl.sum(q.to(tl.float32) * new_k.to(tl.float32), axis=1) * qk_scale  # [BLOCK_G]
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            if USE_DOT:  # as the tiles' p @ v rounds p
                if KV_FP8:
                    p_new = p_new.to(q.dtype).to(tl.float32)
                else:
                    p_new = p_new.to(v_ptr.dtype.element_ty).to(tl.float32)
            acc = acc * alpha[:, None] + p_new[:, None] * new_v.to(tl.float32)
            m_i = m_new
            if new_slot >= 0:  # into the cache for the next steps (nothing in this launch reads it back)
                dst = (new_slot // PAGE) * stride_b + (new_slot % PAGE) * stride_s + offs_d[None, :] * stride_d
                tl.store(k_base + dst, new_k, mask=d_mask[None, :])
                tl.store(v_base + dst, new_v, mask=d_mask[None, :])

    has_kv = l_i > 0.0
    o = acc / tl.where(has_kv, l_i, 1.0)[:, None]  # empty share or seq_len 0 -> zeros, never NaN
    if DIRECT_OUT:
        _store_heads(out_ptr, oscale_ptr, b, kvh, heads, offs_d, o, mask, stride_ob, stride_oh, stride_od, KV_HEADS,
                     FP8_OUT, q_ptr.dtype.element_ty)
    else:
        row = (b.to(tl.int64) * num_heads + heads) * num_splits + split  # [BLOCK_G] into [B, H, splits]
        tl.store(ws_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask)
        lse = tl.where(has_kv, m_i + tl.log2(tl.where(has_kv, l_i, 1.0)), float("-inf"))
        tl.store(ws_lse_ptr + row, lse, mask=g_mask)
        # Count in (release: the partials above first, from every thread); the last to arrive merges.
        tl.debug_barrier()
        count_ptr = counts_ptr + b.to(tl.int64) * KV_HEADS + kvh
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == _used_splits(seq_len, num_splits, one_tile_max, BLOCK_N) - 1:
            tl.store(count_ptr, 0)
            _merge_splits(ws_o_ptr, ws_lse_ptr, out_ptr, oscale_ptr, b, kvh, seq_len, num_splits, one_tile_max,
                          num_heads, stride_ob, stride_oh, stride_od, GROUP, HEAD_DIM, BLOCK_D, MERGE_G, MERGE_S,
                          BLOCK_N,
                          KV_HEADS, FP8_OUT, q_ptr.dtype.element_ty)


@triton.jit
def _split_tiles(num_tiles, num_splits, one_tile_max):
    """KV tiles in each split's share: the sequence's tiles spread evenly over the splits, but two or more once it
    has more than one_tile_max tiles (past that, one-tile shares would be more programs than the SMs run well at
    once: decode_one_tile_programs), the last splits then left empty."""
    tiles = tl.maximum(tl.cdiv(num_tiles, num_splits), 1)
    return tl.where(num_tiles > one_tile_max, tl.maximum(tiles, 2), tiles)


@triton.jit
def _used_splits(seq_len, num_splits, one_tile_max, BLOCK_N: tl.constexpr):
    """How many leading splits of a sequence hold KV tiles (the split kernel's shares, from seq_len)."""
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    return tl.cdiv(num_tiles, _split_tiles(num_tiles, num_splits, one_tile_max))  # 0 when seq_len is 0


@triton.jit
def _merge_splits(ws_o_ptr, ws_lse_ptr, out_ptr, oscale_ptr, b, kvh, seq_len, num_splits, one_tile_max, num_heads,
                  stride_ob, stride_oh, stride_od, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_N: tl.constexpr,
                  KV_HEADS: tl.constexpr, FP8_OUT: tl.constexpr, dt: tl.constexpr):
    # Heads head0 .. head0 + GROUP - 1 (kv head kvh's) of sequence b: the splits' normalized partials weighted by exp2(lse),
    # read past L1 (.cg: other programs wrote them during this kernel). All the group's heads at once, MERGE_S
    # splits a round (one round up to MERGE_S used splits): each round's loads are one batch of L2 round trips,
    # where a loop over the heads waited for one head's loads before issuing the next head's.
    head0 = kvh * GROUP
    offs_g = tl.arange(0, MERGE_G)
    offs_s = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    used = _used_splits(seq_len, num_splits, one_tile_max, BLOCK_N)
    rows = (b.to(tl.int64) * num_heads + head0 + offs_g) * num_splits  # [G]: each head's first split
    m = tl.full([MERGE_G], float("-inf"), tl.float32)
    denom = tl.zeros([MERGE_G], tl.float32)
    acc = tl.zeros([MERGE_G, BLOCK_D], tl.float32)
    for s0 in range(0, used, MERGE_S):
        idx = rows[:, None] + (s0 + offs_s)[None, :]  # [G, S]
        gs_mask = g_mask[:, None] & ((s0 + offs_s) < used)[None, :]
        lse = tl.load(ws_lse_ptr + idx, mask=gs_mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(ws_o_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                    mask=gs_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # every split empty so far: weights 0, never NaN
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse - m_ref[:, None])  # [G, S]
        denom = denom * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        m = m_new
    res = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    _store_heads(out_ptr, oscale_ptr, b, kvh, head0 + offs_g, offs_d, res, g_mask[:, None] & d_mask[None, :],
                 stride_ob, stride_oh, stride_od, KV_HEADS, FP8_OUT, dt)


def _merge_tile(group: int, block_d: int, num_splits: int, programs: int = 0, num_sms: int = 0) -> tuple[int, int]:
    """(MERGE_G, MERGE_S): the merge's [heads, splits] tile, MERGE_VALUES fp32 partial values a round, or
    MERGE_VALUES_ONE_WAVE where the grid's `programs` fit 3 to an SM. Every round is a dependent trip to L2 at
    the end of the critical path: on an H200 (h200_s17_kernels_merge*.json at bd15627, batch 1, 8 kv heads, 32 splits)
    one round instead of four took 2,048 positions from 11.3 to 9.9 us and 8,192 from 20.1 to 18.4; at batch 2-4,
    whose grids then no longer fit one wave, the larger tile was slower (8,192 positions at batch 4: 54.4
    against 46.6 us)."""
    merge_g = triton.next_power_of_2(group)
    values = MERGE_VALUES_ONE_WAVE if programs and programs <= 3 * num_sms else MERGE_VALUES
    merge_s = max(1, min(triton.next_power_of_2(num_splits), values // (merge_g * block_d)))
    return merge_g, merge_s


# Decode programs resident per SM with ~32 KiB and ~16 KiB tiles at 4 warps and 3 stages, as the sweeps in
# decode_block_n fit them on an H200: 3 (one K and one V tile in shared memory, 74 KiB at head_dim 128) and 4
# (registers).
DECODE_PROGRAMS_PER_SM = (3, 4)
# One-tile split programs an SM past which each split takes two tiles (decode_one_tile_programs).
ONE_TILE_PROGRAMS_PER_SM = 2


def _decode_stages(use_dot: bool, kv_fp8: bool, num_splits: int) -> int:
    """num_stages of the decode kernel. The block-table load of a tile takes pipeline stages of its own, so at 3
    stages the K and V tiles get one buffer each and every tile's copies wait for the tile before them to be
    done (the prefill kernel's lesson, see _prefill_config); 5 double-buffers them. With bf16 tiles (32 KiB)
    that costs the programs per SM it buys; FP8 tiles (16 KiB) fit two buffers in the shared memory one bf16
    buffer takes (74 KiB at head_dim 128, as the sm90 compile test checks). On an H200 (h200_s16_kernels_fp8_
    stages{3,5}.json) batch 32 x 8 kv heads, unsplit, ran 7-12% faster at 5 stages over 512-2048 positions;
    split contexts (batch 1: one tile a split) ran 3-8% slower, so they keep 3."""
    if not use_dot:
        return 2
    return 5 if kv_fp8 and num_splits == 1 else 3


def _last_wave_fill(programs: int, per_sm: int, num_sms: int) -> float:
    """programs / the program slots of the waves they take (1.0: every wave full)."""
    slots = per_sm * num_sms
    return programs / (triton.cdiv(programs, slots) * slots)


def decode_block_n(head_dim: int, dtype: torch.dtype, programs: int = 0, num_sms: int = 0) -> int:
    """KV positions per decode tile: ~16 KiB of K (and of V) per tile while batch x kv heads programs leave SMs
    to splits; once they fill the SMs, ~32 KiB unless 16 KiB tiles fill the last wave of programs better.
    Swept on an H200 (2026-11-24; benchmarks/results/ at bd15627): at batch 32 x 512-2048 tokens 128-position tiles (3 stages)
    ran 0.98x SDPA where 64 ran 0.83-0.92x; at batch 1 the smaller tiles keep more splits busy over a short
    context. Past a wave the time follows how full the last wave is (2026-11-25, head_dim 128, 512 tokens: 64 positions 17-21% faster at 448 and 512 programs, 2-5% at 832-1,024,
    128 positions 14% faster at 576 and 640, 1-3% at 1,216 and 1,280; the estimate below picks the faster at
    16 of the 18 points swept, and at 384 programs, the two others, costs 2%)."""
    per_tile = triton.next_power_of_2(head_dim) * dtype.itemsize
    big, small = (max(16, min(128, tile_bytes // per_tile)) for tile_bytes in (32768, 16384))
    if not num_sms or programs < num_sms:
        return small
    if big == small:
        return big
    fill_big = _last_wave_fill(programs, DECODE_PROGRAMS_PER_SM[0], num_sms)
    fill_small = _last_wave_fill(programs, DECODE_PROGRAMS_PER_SM[1], num_sms)
    return small if fill_small > fill_big else big


def choose_num_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int,
    *, min_tiles_per_split: int = MIN_TILES_PER_SPLIT, programs_per_sm: int = PROGRAMS_PER_SM,
) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe); correctness never depends on the value.

    One split once batch x kv heads fill the SMs; below that, batch x kv heads x splits aims at one wave of
    programs_per_sm programs an SM, but no split gets fewer than min_tiles_per_split tiles of the static
    bound max_seq_len (the device spreads a sequence's actual tiles over the splits, so in a graph captured
    for max_model_len short contexts leave the last splits empty). MAX_SPLITS caps it (TANDEM_DECODE_MAX_SPLITS,
    read at import, changes the cap for tuning runs): on an H200, bs1 (7 splits of one tile) ran 1.13x faster
    than unsplit with no reduce kernel, 1.06x than 2 splits, 1.01x than 4 (2026-11-25;
    benchmarks/results/ at bd15627); at batch 1 with 8 kv heads and a static bound of 8,192 positions, 32 splits ran 1,024-8,192
    positions 0-17% faster than 64 (2026-11-25: fewer empty programs, a shorter merge).
    """
    programs = max(1, batch * num_kv_heads)
    if programs >= num_sms:
        # A wave of whole sequences already: on an H200 (h200_s5_kernels_sweep.json at bd15627) batch 32 x 8 kv heads ran
        # fastest unsplit (25.9 us at 512 tokens, 30.6 with the 3 splits of the waves rule below).
        return 1
    # Whole waves only: at batch 8 x 8 kv heads, 9 splits (576 programs, 4 an SM fit 528) ran 8,192 positions in
    # 89.6 us, 8 splits in 76.5 (h200_s17_kernels_splits_sweep.json at bd15627).
    want = max(1, programs_per_sm * num_sms // programs)
    worth = triton.cdiv(triton.cdiv(max(max_seq_len, 1), block_n), max(1, min_tiles_per_split))
    return max(1, min(want, worth, MAX_SPLITS))


def decode_one_tile_programs(num_sms: int) -> int:
    """One-tile split programs the GPU takes at once: a sequence whose tiles times batch x kv heads exceed it is
    split into shares of two tiles or more (decided on the device from seq_len). ONE_TILE_PROGRAMS_PER_SM an SM
    (TANDEM_DECODE_ONE_TILE_PER_SM=N, read per call; a CUDA graph keeps what its capture chose). On an H200
    (h200_s18_kernels_*.json at bd15627, 8 kv heads, static bound 8,192) two-tile shares everywhere took batch 2 at 2,048
    positions from 15.4 to 13.7 us (512 one-tile programs against 256 of two), batch 4 at 1,024 from 14.2 to 13.2
    and batch 8 at 512 from 13.6 to 13.1, but slowed the points with at most 256 one-tile programs (batch 1 at
    1,024 from 8.3 to 9.6 us, bs1 from 284 to 273 tok/s); this budget keeps those at one tile a share."""
    override = os.environ.get("TANDEM_DECODE_ONE_TILE_PER_SM")
    per_sm = int(override) if override else ONE_TILE_PROGRAMS_PER_SM
    return max(0, per_sm) * num_sms


def decode_workspace_numel(batch: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements the split partials need: outputs [B, H, splits, D] then logsumexps [B, H, splits]."""
    return batch * num_heads * num_splits * (head_dim + 1)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> tuple[int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share dtype and strides (two halves of one kv_cache layer)")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim {head_dim} not supported (16..256)")
    return num_kv_heads, num_heads // num_kv_heads


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches: 3xTF32 keeps ~fp32 accuracy on tensor cores (plain tf32 would lose ~1e-3, and IEEE fp32
    # dots spill registers heavily on sm_90). fp16/bf16 operands ignore the setting.
    return "tf32x3" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True, slots=True)
class NewTokens:
    """This step's raw k and v rows (one token per sequence) and what rotates them, for the decode kernel's
    fused rotary: it then also takes the raw (unrotated) q, and writes k and v into the cache itself."""

    k: torch.Tensor  # [B, num_kv_heads, head_dim], unit inner stride (a view of the fused qkv output)
    v: torch.Tensor  # [B, num_kv_heads, head_dim]
    cos: torch.Tensor  # [B, (1,) head_dim // 2]: rotary of every dim (no partial rotary)
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [>= B]; -1: write nothing (padding rows)
    q_norm_weight: torch.Tensor | None = None  # [head_dim] per-head RMSNorm of q and k first (Qwen3), both or neither
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


def _split_counter(device: torch.device, numel: int) -> torch.Tensor:
    """Arrival counts of the decode splits, one int32 per (sequence, kv head), zero between launches (the
    merging program resets its own). One buffer per device (persistent_state)."""
    return persistent_state("the decode attention's split counters", device, numel,
                            lambda n: torch.zeros(n, dtype=torch.int32, device=device), 4096)


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]; with new_tokens, the raw q before rotary
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D]
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    workspace: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    order: torch.Tensor | None = None,  # [B] int32: a permutation of the rows, the order programs start in
    new_tokens: NewTokens | None = None,
    out_scale: torch.Tensor | None = None,  # [B, num_kv_heads] fp32: out is float8_e4m3fn, quantized in groups
    one_tile_programs: int | None = None,  # one-tile split programs at most (decode_one_tile_programs)
) -> torch.Tensor:
    """One query token per sequence attending to its whole context (split-KV flash decoding), in one kernel:
    with several splits per sequence the last split to finish merges the partials.

    Graph-capturable: no host sync; num_splits comes from shapes and the static bound max_seq_len
    (default block_tables.shape[1] * block_size), never from seq_lens. `workspace` is an optional
    preallocated fp32 buffer of at least decode_workspace_numel(...) elements. `order` (the runner's: longest
    context first) only changes which programs start first, never a result. With `new_tokens` the kernel also
    does what rotary_write_kv_triton would have done first: (q/k RMSNorm,) rotary on q and k, and the cache
    write of k and v (q, k and v themselves are left as they are). With `out_scale`, `out` (float8_e4m3fn) gets
    the output quantized for an FP8 o_proj, one group per (sequence, kv head): its query heads' values, rounded
    to q's dtype, over their |max| (quantize_activation_groups_ref); out_scale[b, kv head] is the group's scale.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_heads, head_dim], got {tuple(q.shape)}")
    num_kv_heads, group = _check_cache(k_cache, v_cache, q)
    batch, num_heads, head_dim = q.shape
    page = k_cache.shape[1]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match batch {batch}")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty_like(q, dtype=FP8_DTYPE if out_scale is not None else q.dtype)
    elif out.shape != q.shape:
        raise ValueError(f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    if out_scale is not None and (out.dtype != FP8_DTYPE or out_scale.dtype != torch.float32
                                  or out_scale.shape != (batch, num_kv_heads) or not out_scale.is_contiguous()):
        raise ValueError(f"FP8 output needs out in {FP8_DTYPE} and a contiguous fp32 out_scale [{batch}, "
                         f"{num_kv_heads}], got {out.dtype} and {out_scale.dtype} {tuple(out_scale.shape)}")
    rot = _check_new_tokens(new_tokens, q, num_kv_heads) if new_tokens is not None else None
    if batch == 0:
        return out

    num_sms = device_sms(q.device)
    block_n = block_n or decode_block_n(head_dim, k_cache.dtype, batch * num_kv_heads, num_sms)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * page
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len, block_n, num_sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if one_tile_programs is None:
        one_tile_programs = decode_one_tile_programs(num_sms)
    use_dot = group > 1
    block_g = max(16, triton.next_power_of_2(group)) if use_dot else 1
    block_d = triton.next_power_of_2(head_dim)
    merge_g, merge_s = _merge_tile(group, block_d, num_splits, batch * num_kv_heads * num_splits, num_sms)

    ws_o = ws_lse = counts = out  # placeholders, unused when the kernel writes out directly
    if num_splits > 1:
        numel = decode_workspace_numel(batch, num_heads, head_dim, num_splits)
        if workspace is None:
            workspace = torch.empty(numel, dtype=torch.float32, device=q.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < numel or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous fp32 tensor of >= {numel} elements")
        split_o = batch * num_heads * num_splits * head_dim
        ws_o, ws_lse = workspace[:split_o], workspace[split_o:numel]
        counts = _split_counter(q.device, batch * num_kv_heads)

    pdl = use_pdl(q.device)
    kv_fp8 = is_fp8_cache(k_cache)
    if order is not None and order.shape != (batch,):
        raise ValueError(f"order must be [{batch}], got {tuple(order.shape)}")
    if rot is None:  # placeholders for the rotary arguments
        nk, nv, cos, sin, qw, kw, slots, eps = q, q, q, q, q, q, seq_lens, 1e-6
        rot_strides = (0,) * 6
    else:
        nk, nv, cos, sin, qw, kw, slots, eps = rot
        rot_strides = (nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1), cos.stride(0), sin.stride(0))
    _decode_split_kernel[(batch * num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, order if order is not None else seq_lens, out,
        out_scale if out_scale is not None else seq_lens, ws_o, ws_lse,
        counts, nk, nv, cos, sin, qw, kw, slots, eps,
        scale * LOG2E, num_splits,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(), *rot_strides,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page, BLOCK_N=block_n,
        MERGE_G=merge_g, MERGE_S=merge_s, USE_DOT=use_dot, DOT_PRECISION=_dot_precision(compute_dtype(q, k_cache)),
        DIRECT_OUT=num_splits == 1, USE_PDL=pdl, KV_HEADS=num_kv_heads, HAS_ORDER=order is not None,
        ROTARY=rot is not None, HAS_NORM=rot is not None and new_tokens.q_norm_weight is not None,  # type: ignore[union-attr]
        LINES=triton.next_power_of_2(triton.cdiv(head_dim * k_cache.element_size(), 128)), FP8_OUT=out_scale is not None,
        KV_FP8=kv_fp8, KV_DT=fp8_cache_dot_dtype(q.dtype), ONE_TILE_PROGRAMS=min(max(0, one_tile_programs), 2**30),
        num_warps=num_warps or 4, num_stages=num_stages or _decode_stages(use_dot, kv_fp8, num_splits),
        launch_pdl=bool(pdl),
    )
    return out


def _check_new_tokens(new: NewTokens, q: torch.Tensor, num_kv_heads: int) -> tuple:
    batch, _, head_dim = q.shape
    kv_shape = (batch, num_kv_heads, head_dim)
    if new.k.shape != kv_shape or new.v.shape != kv_shape:
        raise ValueError(f"new k {tuple(new.k.shape)} / v {tuple(new.v.shape)} must be {kv_shape}")
    if new.k.stride(2) != 1 or new.v.stride(2) != 1:
        raise ValueError("new k and v need a unit inner stride")
    cos, sin = check_rotary_args(batch, head_dim, new.cos, new.sin, new.slot_mapping, new.q_norm_weight,
                                 new.k_norm_weight)
    # The kernel steps through a row of cos / sin with unit stride (rows by their own stride).
    cos, sin = (t if t.stride(1) == 1 else t.contiguous() for t in (cos, sin))
    qw, kw = new.q_norm_weight, new.k_norm_weight
    if qw is not None and kw is not None:
        qw, kw = qw.contiguous(), kw.contiguous()
    else:
        qw = kw = cos
    return new.k, new.v, cos, sin, qw, kw, new.slot_mapping, float(new.eps)


# ----------------------------------------------------------------------------- prefill


@triton.jit
def _prefill_tile(
    acc, m_i, l_i, q, pos, tile, k_base, v_base, bt_row, kv_end, qk_scale,
    stride_b, stride_s, stride_d,
    offs_n0, offs_d, d_mask,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, KV_FP8: tl.constexpr,
):
    # One BLOCK_N tile of keys for a BLOCK_M tile of query rows; MASKED tiles straddle the diagonal
    # or the end of the context, unmasked ones are visible to every row.
    offs_n = tile * BLOCK_N + offs_n0
    n_mask = offs_n < kv_end
    kv_rows = _kv_tile_rows(bt_row, offs_n, n_mask, stride_b, stride_s, PAGE, MASKED)
    k = _load_rows(k_base, kv_rows, offs_d, stride_d, n_mask, d_mask, MASKED, HEAD_DIM != BLOCK_D)
    if KV_FP8:  # e4m3 widened to q's dtype (KV_DT) exactly; the dots run in it
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where((offs_n[None, :] <= pos[:, None]) & n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 (first tile) or an earlier tile was visible
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_rows(v_base, kv_rows, offs_d, stride_d, n_mask, d_mask, MASKED, HEAD_DIM != BLOCK_D)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# A mixed step hands the prefill kernel its metadata from row num_decodes on: the pointers' 16-byte alignment
# varies with that count and is worth nothing to these scalar loads, so it must not pick kernel variants
# (each a compile, ~1 s, in the middle of serving).
@triton.jit(do_not_specialize_on_alignment=["bt_ptr", "qsl_ptr", "seq_lens_ptr"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_b, stride_s, stride_h, stride_d,  # shared by k_cache and v_cache
    stride_btb,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    KV_FP8: tl.constexpr, KV_DT: tl.constexpr,
):
    # Program (row tile, sequence, kv head). A sequence's query rows are its (token, group head) pairs,
    # row = token * GROUP + g, so the GQA heads sharing a kv head share every K/V tile load.
    # Row tiles run last-first: the tiles with the longest causal range start earliest.
    pdl_wait(USE_PDL)
    tile_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    num_rows = q_len * GROUP
    r0 = tile_m * BLOCK_M
    if r0 >= num_rows:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_start = seq_len - q_len  # absolute position of the first new token (prefix / earlier chunks before it)

    offs_r = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    r_mask = offs_r < num_rows
    d_mask = offs_d < HEAD_DIM
    tok = offs_r // GROUP
    heads = kvh * GROUP + offs_r % GROUP
    pos = ctx_start + tok
    tok_idx = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok_idx[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:  # the dots run in KV_DT, which an FP8 cache's tiles are widened to
        q = q.to(KV_DT)
    else:  # the dots run in the cache's dtype
        q = q.to(k_ptr.dtype.element_ty)

    first_pos = ctx_start + r0 // GROUP
    kv_end = ctx_start + (tl.minimum(r0 + BLOCK_M, num_rows) - 1) // GROUP + 1  # last row's position + 1
    num_full = (first_pos + 1) // BLOCK_N  # tiles every row of this tile sees entirely
    num_tiles = tl.cdiv(kv_end, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + kvh * stride_h
    v_base = v_ptr + kvh * stride_h
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for tile in range(0, num_full):
        acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, pos, tile, k_base, v_base, bt_row, kv_end, qk_scale,
                                      stride_b, stride_s, stride_d,
                                      offs_n0, offs_d, d_mask, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N,
                                      DOT_PRECISION, False, KV_FP8)
    for tile in range(num_full, num_tiles):
        acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, pos, tile, k_base, v_base, bt_row, kv_end, qk_scale,
                                      stride_b, stride_s, stride_d,
                                      offs_n0, offs_d, d_mask, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N,
                                      DOT_PRECISION, True, KV_FP8)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok_idx[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def _prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) sized for Hopper shared memory."""
    if dtype == torch.float32 or head_dim > 128:  # fp32 is a correctness path; keep it spill-light
        return 64, 32, 4, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    # 5 stages: the block-table load takes pipeline stages of its own, so at 3 the K/V tiles had one buffer and
    # each tile's loads waited for the tile before it to be done; 5 double-buffers them (scripts/
    # bench_prefill.py, h200_s11_bench_prefill.json at bd15627: 7-12% faster at 512-2048 tokens with 8 warps; 4 warps at
    # 5 stages ran at half the speed).
    return 128, 64, 8, 5


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D]
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention; sequence i's queries are the last query_len_i positions of its context.

    Their K/V must already be in the cache. Rows of q outside every sequence (padding) are left as they
    are in `out`; a freshly allocated out starts at zero so they read as zeros.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    num_kv_heads, group = _check_cache(k_cache, v_cache, q)
    num_tokens, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} / block_tables "
                         f"{tuple(block_tables.shape)} do not match {batch} sequences")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = torch.zeros_like(q)
    elif out.shape != q.shape:
        raise ValueError(f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    if batch == 0 or num_tokens == 0 or max_query_len <= 0:
        return out

    cfg_m, cfg_n, cfg_warps, cfg_stages = _prefill_config(head_dim, compute_dtype(q, k_cache))
    block_m = block_m or cfg_m
    block_n = block_n or cfg_n
    grid = (triton.cdiv(max_query_len * group, block_m), batch, num_kv_heads)
    pdl = use_pdl(q.device)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PAGE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(compute_dtype(q, k_cache)), USE_PDL=pdl,
        KV_FP8=is_fp8_cache(k_cache), KV_DT=fp8_cache_dot_dtype(q.dtype),
        num_warps=num_warps or cfg_warps, num_stages=num_stages or cfg_stages, launch_pdl=bool(pdl),
    )
    return out


# ----------------------------------------------------------------------------- dispatch


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ops.paged_attention contract on Triton: the decode kernel when every sequence has one token; in a
    step that mixes prefills into decodes, the decode kernel for its leading one-token sequences and the
    prefill kernel for the rest (whose grid would otherwise hold max_query_len row tiles for every decode,
    all but one returning at once)."""
    if meta.max_query_len == 1 and q.shape[0] == meta.num_seqs:
        # One token per sequence, in order (query_start_loc == arange): row b is sequence b's query.
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, out,
                                      max_seq_len=meta.max_seq_len, order=meta.decode_order)
    nd = meta.num_decodes
    if 0 < nd < meta.num_seqs:
        # Rows 0..nd-1 are those sequences' tokens; the prefill kernel finds the others' rows through
        # query_start_loc (absolute token offsets), so both write disjoint rows of one output.
        if out is None:
            out = torch.zeros_like(q)
        # One split and the tiles of a full wave, whatever the decode count and context lengths (a mixed
        # step's time goes to its prefill): the variant the largest decode graphs use when the decodes
        # exceed a wave (with meta.decode_order), and the one ModelRunner._warm_mixed_attention compiles
        # for fewer; so no mixed step compiles a kernel.
        block_n = decode_block_n(q.shape[2], k_cache.dtype, device_sms(q.device), device_sms(q.device))
        paged_decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                               out[:nd], num_splits=1, block_n=block_n, order=meta.decode_order)
        return paged_prefill_attention(q, k_cache, v_cache, meta.query_start_loc[nd:], meta.seq_lens[nd:],
                                       meta.block_tables[nd:], meta.max_query_len, scale, out)
    return paged_prefill_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                   meta.max_query_len, scale, out)


__all__ = [
    "NewTokens",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_attention_triton",
    "choose_num_splits",
    "decode_block_n",
    "decode_workspace_numel",
]
