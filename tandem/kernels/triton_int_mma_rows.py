"""The many-row W4A16 product on the tensor cores (sm_80+, bf16 activations): 9 to 32 rows of x, as
a batch of decode steps brings, against a 4-bit IntWeight. Each fragment of 16 weight channels is dequantized once in
registers and multiplied by every row of x (mma.sync m16n8k16, 8 rows of x a fragment's columns), so the weight is
read once and dequantized once whatever the rows; x comes from L1 / L2 for each warp."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.int_weight import WORD_BITS, IntWeight
from tandem.kernels.triton_int_gemv_mma import (
    MMA_MAX_ROWS,
    _quad,
    groups_a_part,
    lane_ids,
    pair_asm,
    part_elements,
    prefetch_parts,
    reads_dense,
    word_offsets,
)
from tandem.kernels.triton_launch import device_sms, pdl_wait, prefetch_l2, use_pdl
from tandem.kernels.triton_quant import defers, finish_split

ROWS_MAX = 32  # rows of x the kernel takes at most (registers: 216-255 a thread at 32 rows)
DEFAULT_ROWS = 32  # rows up to which it runs by default: on an H200, with the weights in tiles, a decode step of the
# Llama-3-8B shape at 24 rows took 4.85 ms against the tile GEMM's 5.31, and seed-async (32 rows) ran 5,835 tok/s
# against 5,653 (before tiles it lost at 32 rows: 4,787 against 5,200)
ONE_PAIR = tl.constexpr(0x3F803F80)  # two bf16 1.0

# A word's four code pairs (int_weight.NIBBLE_ORDER: pair p, elements 2p and 2p + 1, sits at bits 4p and 4p + 16) as
# bf16 pairs 1 + q / 16: (word >> 4p - 3) & 0x00780078 | 0x3F803F80 puts each nibble at the top of its half's
# mantissa (exact). Out: pairs 0, 1, 2, 3.
_DEQUANT_ASM = tl.constexpr("\n".join(
    ["{", ".reg .b32 s, m, one;", "mov.b32 m, 0x00780078;", "mov.b32 one, 0x3F803F80;"]
    + [line for p in range(4) for line in pair_asm(f"${p}", "$4", 4 * p - 3, "one")] + ["}"]))
# D = A B + C, m16n8k16, bf16 A and B, fp32 C and D. Lane (g, t) holds A's rows g and g + 8 at K slots 2t, 2t + 1
# (a0, a1) and 2t + 8, 2t + 9 (a2, a3), B's column g at the same slots (b0, b1), and D's rows g and g + 8 at
# columns 2t, 2t + 1 (d0, d1 row g; d2, d3 row g + 8).
_MMA_ASM = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                        "{$8, $9}, {$10, $11, $12, $13};")


@triton.jit
def _dequant(word):
    return tl.inline_asm_elementwise(asm=_DEQUANT_ASM, constraints="=r,=r,=r,=r,r", args=[word],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return tl.inline_asm_elementwise(asm=_MMA_ASM, constraints="=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                                     args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _int_mma_rows_kernel(
    x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, ws_ptr, M, N, K, K_SPLIT, GROUP: tl.constexpr,
    stride_wn: tl.constexpr, stride_sn: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr, FULL_ROWS: tl.constexpr, ROW_BLOCKS: tl.constexpr, X_BLOCKS: tl.constexpr,
    WARPS: tl.constexpr, PREFETCH_PARTS: tl.constexpr, USE_PDL: tl.constexpr, TILED: tl.constexpr = False,
    X_SPREAD: tl.constexpr = False,
):
    # Program = WARPS x ROW_BLOCKS blocks of 16 weight channels (warp w: blocks w ROW_BLOCKS ..) x all M rows of x
    # (X_BLOCKS blocks of 8) over K range [pid_k * K_SPLIT, +K_SPLIT), one part of 128 elements of K at a time.
    # Every warp reads the same x, so a program's warps share its lines in L1. Lane (g, t) holds words 4t .. 4t + 3
    # of the part (elements 32t .. 32t + 31) of channels g and g + 8 of each of its warp's blocks and, for x block
    # r, row 8r + g of x at the same elements. A part's MMA j (0..7) reads word j // 2's code pairs 2 (j % 2) and
    # 2 (j % 2) + 1 and x's pairs 2j and 2j + 1 of the lane's 16. With f = 1 + q / 16 the MMAs give F = sum x f per
    # (channel, row) and, with A all ones, X = sum x per row; the part adds 16 s (F - X) + mn X (a group holds whole
    # parts, so a part has one scale and min a channel). The MMAs of a step j of every (x block, channel block)
    # are issued together: independent, so their latency overlaps. Lane (g, t) ends with channels g and g + 8 of
    # each block for rows 8r + 2t and 8r + 2t + 1: the output (SPLIT_K 1) or the split's fp32 partial sums, ws
    # [SPLIT_K, M, N]. EVEN: the channels fill whole programs; FULL_ROWS: M a multiple of 8 (no row masked).
    # TILED: the words in tiles of 16 channels x 16 words (int_weight.tile_words): a part of a block is one tile.
    # X_SPREAD: lane t holds words t, t + 4, t + 8, t + 12 instead (elements 32i + 8t ..), and x at the same
    # elements: a 16-byte load of x then reads 64 contiguous bytes of a row over the lanes t, one line, where words
    # 4t .. read four 64-byte pieces of two lines. A warp reads 2 X_BLOCKS / ROW_BLOCKS times as many bytes
    # of x as of weights, and the kernel waits mostly on L1 (ncu on an H200 at 32 rows: 2 warps a scheduler, 51-61%
    # of their stalls on L1TEX for 2 blocks); the weights' load becomes four 4-byte loads a row.
    PART: tl.constexpr = 128
    PART_WORDS: tl.constexpr = 16 if TILED else 1  # a part's first word k0 // 8 of a row lies at k0 // 8 x this
    X_STEP: tl.constexpr = 16 if X_SPREAD else 4  # pairs of x from one of a lane's 16-byte loads to the next
    T: tl.constexpr = 32 * WARPS
    B: tl.constexpr = ROW_BLOCKS
    R: tl.constexpr = X_BLOCKS
    _, warp, g, t, quad, pid_k, k_begin, k_end = lane_ids(WARPS, K_SPLIT, K)
    block0 = tl.program_id(0) * (16 * B * WARPS) + warp * (16 * B)  # [T]: the warp's first channel
    one = tl.full([T], ONE_PAIR, tl.int32)
    x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    # Weight rows (channels g, g + 8 of each block; channels past N read channel N - 1 and store nothing)
    w_rows = ()
    s_rows = ()
    for b in tl.static_range(B):
        for h in tl.static_range(2):
            chan = block0 + 16 * b + 8 * h + g
            if not EVEN:
                chan = tl.minimum(chan, N - 1)
            w_rows = w_rows + (w_ptr + word_offsets(chan, 0, stride_wn, TILED),)
            s_rows = s_rows + (chan.to(tl.int64) * stride_sn,)
            if USE_PDL and PREFETCH_PARTS > 0:  # before the wait: the first parts' lines to L2 (a line holds two
                # parts of a row, or TILED one part of two rows)
                for p in tl.static_range(0, PREFETCH_PARTS, 1 if TILED else 2):
                    prefetch_l2(w_rows[2 * b + h] + (k_begin // 8 + 16 * p) * PART_WORDS,
                                (t == 0) & (k_begin + PART * p < k_end))
    x_rows = ()  # where row 8r + g of x starts, in int32 pairs (rows past M are masked)
    x_keep = ()
    for r in tl.static_range(R):
        x_rows = x_rows + ((8 * r + g) * (K // 2),)
        x_keep = x_keep + (8 * r + g < M,)
    accs = ()
    for i in tl.static_range(4 * B * R):
        accs = accs + (tl.zeros([T], dtype=tl.float32),)
    pdl_wait(USE_PDL)
    for k0 in range(k_begin, k_end, PART):
        if X_SPREAD:  # lane t: words t, t + 4, t + 8, t + 12 (elements 32i + 8t ..), so that a load of x reads 64
            # contiguous bytes of a row across the lanes t (half a line, where 4t .. reads four 64-byte pieces)
            word = (k0 // 8 * PART_WORDS + t)[:, None] + 4 * quad
            x_at = (k0 + 8 * t) // 2
        else:
            word = tl.multiple_of(k0 // 8 * PART_WORDS + 4 * t, 4)[:, None] + quad  # [T, 4]: words 4t .. 4t + 3
            x_at = (k0 + 32 * t) // 2  # x's first pair of the lane's elements, in its row
        group = k0 // GROUP
        # A's registers: (block b, channel half h, word w) -> its four code pairs, at 16 (2b + h) + 4w + p
        a = ()
        scales = ()
        for b in tl.static_range(B):
            for h in tl.static_range(2):
                w0, w1, w2, w3 = _quad(tl.load(w_rows[2 * b + h][:, None] + word))
                p0, p1, p2, p3 = _dequant(w0)
                p4, p5, p6, p7 = _dequant(w1)
                p8, p9, p10, p11 = _dequant(w2)
                p12, p13, p14, p15 = _dequant(w3)
                a = a + (p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15)
                scales = scales + (tl.load(s_ptr + s_rows[2 * b + h] + group).to(tl.float32) * 16.0,
                                   tl.load(mn_ptr + s_rows[2 * b + h] + group).to(tl.float32))
        # x's pairs of every x block: 16 a block, at 16 r + i
        xs = ()
        for r in tl.static_range(R):
            xp = x_words + tl.multiple_of(x_rows[r] + x_at, 4)[:, None] + quad  # [T, 4]: the first four pairs
            for i in tl.static_range(4):  # the lane's next four pairs: 4 further on, or X_SPREAD 16
                if FULL_ROWS:
                    x0, x1, x2, x3 = _quad(tl.load(xp + X_STEP * i))
                else:
                    x0, x1, x2, x3 = _quad(tl.load(xp + X_STEP * i, mask=x_keep[r][:, None], other=0))
                xs = xs + (x0, x1, x2, x3)
        # The chains: (x block r, channel block b) at 4 (r B + b), then X of x block r at 4 (R B + r)
        cs = ()
        for i in tl.static_range(4 * (B + 1) * R):
            cs = cs + (tl.zeros([T], dtype=tl.float32),)
        for j in tl.static_range(8):  # a0, a2: channel g's word j // 2, pairs 2 (j % 2) and + 1; a1, a3: g + 8's
            nxt = ()
            for r in tl.static_range(R):
                for b in tl.static_range(B):
                    d0, d1, d2, d3 = _mma(a[32 * b + 4 * (j // 2) + 2 * (j % 2)],
                                          a[32 * b + 16 + 4 * (j // 2) + 2 * (j % 2)],
                                          a[32 * b + 4 * (j // 2) + 2 * (j % 2) + 1],
                                          a[32 * b + 16 + 4 * (j // 2) + 2 * (j % 2) + 1],
                                          xs[16 * r + 2 * j], xs[16 * r + 2 * j + 1],
                                          cs[4 * (r * B + b)], cs[4 * (r * B + b) + 1], cs[4 * (r * B + b) + 2],
                                          cs[4 * (r * B + b) + 3])
                    nxt = nxt + (d0, d1, d2, d3)
            for r in tl.static_range(R):
                d0, d1, d2, d3 = _mma(one, one, one, one, xs[16 * r + 2 * j], xs[16 * r + 2 * j + 1],
                                      cs[4 * (R * B + r)], cs[4 * (R * B + r) + 1], cs[4 * (R * B + r) + 2],
                                      cs[4 * (R * B + r) + 3])
                nxt = nxt + (d0, d1, d2, d3)
            cs = nxt
        new = ()
        for r in tl.static_range(R):
            sum_a = cs[4 * (R * B + r)]  # X of row 8r + 2t
            sum_b = cs[4 * (R * B + r) + 1]  # and of row 8r + 2t + 1
            for b in tl.static_range(B):
                s_lo, mn_lo, s_hi, mn_hi = scales[4 * b], scales[4 * b + 1], scales[4 * b + 2], scales[4 * b + 3]
                new = new + (accs[4 * (r * B + b)] + s_lo * (cs[4 * (r * B + b)] - sum_a) + mn_lo * sum_a,
                             accs[4 * (r * B + b) + 1] + s_lo * (cs[4 * (r * B + b) + 1] - sum_b) + mn_lo * sum_b,
                             accs[4 * (r * B + b) + 2] + s_hi * (cs[4 * (r * B + b) + 2] - sum_a) + mn_hi * sum_a,
                             accs[4 * (r * B + b) + 3] + s_hi * (cs[4 * (r * B + b) + 3] - sum_b) + mn_hi * sum_b)
        accs = new
    # Lane (g, t): channels g, g + 8 x rows 2t, 2t + 1 of each (x block, channel block), stored as they are
    for r in tl.static_range(R):
        for b in tl.static_range(B):
            for i in tl.static_range(4):
                row = 8 * r + 2 * t + i % 2
                chan = block0 + 16 * b + g + 8 * (i // 2)
                mask = (row < M) & (chan < N)
                y = accs[4 * (r * B + b) + i]
                if SPLIT_K == 1:
                    if HAS_BIAS:
                        y = y + tl.load(b_ptr + chan, mask=mask, other=0.0).to(tl.float32)
                    tl.store(out_ptr + row * N + chan, y.to(out_ptr.dtype.element_ty), mask=mask)
                else:
                    tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + row * N + chan, y, mask=mask)


def rows_max() -> int:
    """Rows up to which the many-row kernel runs (above MMA_MAX_ROWS, where the few-row GEMV stops): DEFAULT_ROWS,
    or TANDEM_INT_MMA_ROWS_MAX up to ROWS_MAX (MMA_MAX_ROWS or less: never; read per call: a CUDA graph keeps what
    its capture chose)."""
    return min(int(os.environ.get("TANDEM_INT_MMA_ROWS_MAX", str(DEFAULT_ROWS))), ROWS_MAX)


def use_mma_rows(x: torch.Tensor, weight: IntWeight) -> bool:
    """Whether the many-row kernel takes this product: more than MMA_MAX_ROWS and up to rows_max() rows of bf16 x,
    contiguous with 16-byte aligned rows, against a contiguous 4-bit IntWeight whose groups hold whole parts (128
    elements), on a GPU with bf16 mma.sync."""
    return (MMA_MAX_ROWS < x.shape[0] <= rows_max() and x.dim() == 2 and weight.words.dim() == 2
            and weight.bits == 4 and groups_a_part(4, weight.group_size) == 1 and x.is_contiguous()
            and reads_dense(x, weight))


def mma_rows_config(n: int, k: int, sms: int) -> dict[str, int]:
    """Tile from the weight's shape alone (graph-safe; the same for every row count): 4 warps of ROW_BLOCKS blocks of 16 channels a program (its warps read
    the same x: more channels a program read it fewer times), 4 blocks a warp where N still gives half the SMs a
    program, else 2, and K split over programs (whole parts) until the grid holds 1.5 programs an SM, each split at
    least four parts. On an H200 (scripts/bench_int_weight.py --rows 16,32 --sweep, the Llama-3-8B projections)
    these were the fastest tiles but one (qkv at 32 rows: 4 blocks, 18.0 against 20.0 us)."""
    warps, parts = 4, k // part_elements(4)
    blocks = 4 if n // (16 * 4 * warps) >= sms // 2 else 2
    programs, split_k = triton.cdiv(n, 16 * blocks * warps), 1
    while 2 * programs * split_k < 3 * sms and split_k < 8 and parts >= 8 * split_k:
        split_k *= 2
    return {"ROW_BLOCKS": blocks, "SPLIT_K": split_k, "num_warps": warps}


def mma_rows_k_split(k: int, split_k: int) -> int:
    """Elements of K a program takes: whole parts."""
    return triton.cdiv(triton.cdiv(k, part_elements(4)), split_k) * part_elements(4)


def mma_rows_constexprs(m: int, n: int, k: int, group_size: int, cfg: dict[str, int], has_bias: bool,
                        pdl: int, tiled: bool = False) -> dict:
    """The kernel's compile-time arguments for a config (also scripts/sass_int_gemv.py's); tiled: the weight's
    words in tiles (int_weight.tile_words). X_SPREAD (cfg's, else on at 2 channel blocks and 25 to 32 rows): on an
    H200 at 32 rows it took the 8B qkv, o and down from 17.5, 12.2 and 31.3 us to 15.4, 10.6 and 26.6; at 16 rows,
    and for gate_up's 4 blocks at 32 (71 us against 51), it was slower."""
    warps, blocks = cfg["num_warps"], cfg["ROW_BLOCKS"]
    x_blocks = triton.cdiv(m, 8)
    return dict(GROUP=group_size, stride_wn=k * 4 // WORD_BITS, stride_sn=k // group_size, HAS_BIAS=has_bias,
                SPLIT_K=triton.cdiv(k, mma_rows_k_split(k, cfg["SPLIT_K"])), EVEN=n % (16 * blocks * warps) == 0,
                FULL_ROWS=m % 8 == 0, ROW_BLOCKS=blocks, X_BLOCKS=x_blocks, WARPS=warps,
                PREFETCH_PARTS=prefetch_parts() if pdl else 0, USE_PDL=pdl, TILED=tiled,
                X_SPREAD=bool(cfg.get("X_SPREAD", blocks == 2 and x_blocks == 4)))


def int_mma_rows(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None, defer: bool = False,
                 config: dict[str, int] | None = None) -> torch.Tensor | PartialSums:
    """x W^T + b for bf16 rows x [M, K] (use_mma_rows holds) on the tensor cores; grid and workspace from the shape
    alone (captures in CUDA graphs). With `defer` (and TANDEM_DEFER_REDUCE not 0) a K split hands its fp32 partial
    sums on; otherwise the reduce kernel adds them. config: overrides mma_rows_config's entries (benchmarks)."""
    n, k = weight.shape
    m = x.shape[0]
    if m > ROWS_MAX:
        raise ValueError(f"the many-row kernel takes at most {ROWS_MAX} rows, got {m}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = {**mma_rows_config(n, k, device_sms(x.device)), **(config or {})}
    pdl = use_pdl(x.device)
    flags = mma_rows_constexprs(m, n, k, weight.group_size, cfg, bias is not None, pdl, weight.tiled)
    split_k = flags["SPLIT_K"]
    k_split = mma_rows_k_split(k, cfg["SPLIT_K"])
    ws = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    w, scales = weight.words, weight.scales
    _int_mma_rows_kernel[(triton.cdiv(n, 16 * cfg["ROW_BLOCKS"] * cfg["num_warps"]), split_k)](
        x, w, scales, weight.mins, bias if bias is not None else scales, out, ws, m, n, k, k_split, **flags,
        num_warps=cfg["num_warps"], num_stages=1, launch_pdl=bool(pdl))
    return finish_split(ws, out, bias, split_k, defers(defer))
