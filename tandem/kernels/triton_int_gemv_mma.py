"""The one-row W4A16 / W8A16 GEMV on the tensor cores (sm_80+, bf16 activations): IntWeight codes become bf16
MMA operands with one shift and one and-or per two codes (two nibbles of a byte at 8 bits), and mma.sync sums
them with x in fp32."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.int_weight import WORD_BITS, IntWeight
from tandem.kernels.triton_launch import device_sms, pdl_wait, persistent_state, prefetch_l2, use_pdl
from tandem.kernels.triton_moe import pair_expert
from tandem.kernels.triton_quant import defers, finish_split


PROGRAMS_PER_SM = 8  # the most programs of 4 warps a GEMV's grid gives each SM (mma_gemv_config)
MMA_MAX_ROWS = 8  # rows of x the GEMV takes at most: one a column of B


def part_elements(bits: int) -> int:
    """Elements of K one warp multiplies per loop iteration: 4 lanes x 4 words of 32 // bits codes."""
    return 16 * WORD_BITS // bits


# The kernel's MMAs: m16n8k16, bf16 A and B, fp32 sums. Lane (g, t) = (lane // 4, lane % 4) holds A's rows g
# and g + 8 at K slots 2t, 2t + 1 (a0, a1) and 2t + 8, 2t + 9 (a2, a3), B's column g at the same slots (b0, b1)
# and the sums' rows g and g + 8 at columns 2t, 2t + 1 (c0, c1 and c2, c3). x fills every column of B, so a
# row's sum is in every lane of its g. Any order of K works as long as A and B agree: a part's MMA j reads the
# codes of word j // 2 of the lane's four, in whatever slots the and-or leaves them, and B holds x's elements of
# the same slots. A shift that brings a nibble to bits 3-6 of each half, then an and-or of 0x00780078 and a bf16
# pair of MAGIC, puts it at the top of each half's mantissa: 0x3F80 | q << 3 is 1 + q / 16, 0x4180 | q << 3 is
# 16 + q (bf16 keeps 8 significant bits: both exact). The codes sit beside an offset of 1 (or 17 at 8 bits), not
# 128: F - OFFSET X then cancels a bit or two of the fp32 sums, not four.
_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, d1, $1, d3}, {a0, a1, a2, a3}, {B0, B1}, "
        "{$0, d1, $1, d3};")


def _part_asm(bits: int, cols: int = 1) -> str:
    # One part of rows g and g + 8 of a block: words 4t .. 4t + 3 of the part of row g, then of row g + 8, then
    # B's registers (operands numbered after the outputs); out: F of row g and g + 8 over the part, chained from
    # zero over 8 MMAs, of column 2t (cols 1: $0, $1), and with cols 2 of column 2t + 1 too ($2, $3), where B's
    # columns hold x of different groups (small groups, _int_mma_gemv_kernel).
    # 4 bits: pair p of a word (its elements 2p and 2p + 1, bits 4p and 4p + 16: int_weight.NIBBLE_ORDER) is
    #   (word >> 4p - 3) & 0x00780078 | 0x3F803F80 = 1 + q / 16; MMA j takes pairs 2 (j % 2) and 2 (j % 2) + 1
    #   as a0 and a2 and x's pairs 2j and 2j + 1: F = sum x (1 + q / 16).
    # 8 bits: byte i of a word is element i; (word >> 8o - 3) & 0x00780078 | 0x3F803F80 holds the low nibbles of
    #   elements o and o + 2 (1 + lo / 16), (word >> 8o + 1) & 0x00780078 | 0x41804180 their high nibbles
    #   (16 + hi); MMA j takes o = j % 2, the low nibbles as a0, the high as a2, and B = (x_o, x_o+2) of the word
    #   in both: F = sum x (17 + q / 16).
    outs = 2 * cols
    d1, d3 = ("$2", "$3") if cols == 2 else ("d1", "d3")
    lines = ["{", ".reg .b32 m, lo, hi, s, a0, a1, a2, a3;", ".reg .f32 d1, d3;", "mov.b32 m, 0x00780078;",
             "mov.b32 lo, 0x3F803F80;", f"mov.b32 hi, {'0x3F803F80' if bits == 4 else '0x41804180'};"]
    lines += [f"mov.f32 {r}, 0f00000000;" for r in ("$0", "$1", d1, d3)]
    for j in range(8):
        row_g, row_h, shift = f"${outs + j // 2}", f"${outs + 4 + j // 2}", 8 * (j % 2)
        for reg, word, sh, magic in (("a0", row_g, shift - 3, "lo"), ("a2", row_g, shift + 1, "hi"),
                                     ("a1", row_h, shift - 3, "lo"), ("a3", row_h, shift + 1, "hi")):
            lines += pair_asm(reg, word, sh, magic)
        b0, b1 = (outs + 8 + 2 * j, outs + 9 + 2 * j) if bits == 4 else (outs + 8 + j, outs + 8 + j)
        mma = _MMA.replace("d1", d1).replace("d3", d3)
        lines.append(mma.replace("B0", f"${b0}").replace("B1", f"${b1}"))
    return "\n".join(lines + ["}"])


def pair_asm(dst: str, word: str, shift: int, magic: str) -> list[str]:
    # Two codes of `word` as a bf16 pair into dst: the word shifted right by `shift` (left where negative), then
    # & m | magic (the caller declares s and m, m = 0x00780078, and holds magic in a register: one LOP3).
    move = f"shr.u32 s, {word}, {shift};" if shift > 0 else f"shl.b32 s, {word}, {-shift};"
    return [move, f"lop3.b32 {dst}, s, m, {magic}, 0xea;"]


def _sum_asm(bits: int, cols: int = 1) -> str:
    # X = sum_k x_k over the part by MMAs with A all ones (bf16 1.0 pairs), two chains for the latency; the
    # part's contribution to row r is 16 s (F - OFFSET X) + mn X. In: x's registers (16 at 4 bits, 8 at 8 bits,
    # after the outputs); out: X of column 2t ($0), with cols 2 of column 2t + 1 too ($1), and, at 8 bits, B's
    # registers of the words (8: (x_o, x_o+2) of each).
    regs = 16 if bits == 4 else 8
    sums = cols
    first = sums + (0 if bits == 4 else 8)
    lines = ["{", ".reg .b32 one;", ".reg .f32 e<8>;", "mov.b32 one, 0x3F803F80;"]
    lines += [f"mov.f32 e{i}, 0f00000000;" for i in range(8)]
    for j in range(regs // 2):
        c = "e0, e1, e2, e3" if j % 2 == 0 else "e4, e5, e6, e7"
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c}}}, {{one, one, one, one}}, "
                     f"{{${first + 2 * j}, ${first + 2 * j + 1}}}, {{{c}}};")
    if bits == 8:  # x pairs (x0, x1), (x2, x3) of a word -> (x0, x2) and (x1, x3)
        for w in range(4):
            a, b = f"${first + 2 * w}", f"${first + 2 * w + 1}"
            lines += [f"prmt.b32 ${sums + 2 * w}, {a}, {b}, 0x5410;",
                      f"prmt.b32 ${sums + 1 + 2 * w}, {a}, {b}, 0x7632;"]
    lines.append("add.f32 $0, e0, e4;")
    if cols == 2:
        lines.append("add.f32 $1, e1, e5;")
    return "\n".join(lines + ["}"])


PART_ASM_4 = tl.constexpr(_part_asm(4))
PART_ASM_8 = tl.constexpr(_part_asm(8))
SUM_ASM_4 = tl.constexpr(_sum_asm(4))
SUM_ASM_8 = tl.constexpr(_sum_asm(8))
PART_CONSTRAINTS_4 = tl.constexpr("=f,=f," + ",".join(["r"] * 24))
PART_CONSTRAINTS_8 = tl.constexpr("=f,=f," + ",".join(["r"] * 16))
SUM_CONSTRAINTS_4 = tl.constexpr("=f," + ",".join(["r"] * 16))
SUM_CONSTRAINTS_8 = tl.constexpr("=f," + ",".join(["=r"] * 8) + "," + ",".join(["r"] * 8))
# Groups under a part: two columns of sums
PART2_ASM_4 = tl.constexpr(_part_asm(4, 2))
PART2_ASM_8 = tl.constexpr(_part_asm(8, 2))
SUM2_ASM_4 = tl.constexpr(_sum_asm(4, 2))
SUM2_ASM_8 = tl.constexpr(_sum_asm(8, 2))
PART2_CONSTRAINTS_4 = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 24))
PART2_CONSTRAINTS_8 = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 16))
SUM2_CONSTRAINTS_4 = tl.constexpr("=f,=f," + ",".join(["r"] * 16))
SUM2_CONSTRAINTS_8 = tl.constexpr("=f,=f," + ",".join(["=r"] * 8) + "," + ",".join(["r"] * 8))


@triton.jit
def word_offsets(rows, words, stride_wn, TILED: tl.constexpr):
    # Where word `words` of weight row `rows` (broadcast together) lies in an IntWeight's words, int64: row after
    # row (stride_wn words a row), or TILED in tiles of 16 rows x 16 words (int_weight.tile_words).
    if TILED:
        return ((rows // 16).to(tl.int64) * (16 * stride_wn) + (words // 16) * 256 + (rows % 16) * 16
                + words % 16)
    return rows.to(tl.int64) * stride_wn + words


@triton.constexpr_function
def tiled_step(words: int, tiled: bool) -> int:
    # How far a K loop's word pointers move a step of `words` words of each row: as far row after row; in tiles
    # (a tile column of 16 words is 256), 16x as far where the step is whole tile columns, else 0: the loop
    # computes its pointers again each step (word_offsets).
    if not tiled:
        return words
    return 16 * words if words % 16 == 0 else 0


@triton.jit
def lane_ids(WARPS: tl.constexpr, K_SPLIT, K):
    # A program's threads, one element each ([T], T = 32 * WARPS): lane, warp, and the lane's (g, t) = (lane // 4,
    # lane % 4) of the MMA fragments; quad [1, 4], the four int32 of a 16-byte load; the K split (program_id(1))
    # and its range [k_begin, k_end).
    tid = tl.arange(0, 32 * WARPS)
    lane = tid % 32
    pid_k = tl.program_id(1)
    k_begin = pid_k * K_SPLIT
    return (lane, tid // 32, lane // 4, lane % 4, tl.arange(0, 4)[None, :], pid_k, k_begin,
            tl.minimum(k_begin + K_SPLIT, K))


@triton.jit
def _quad(v):
    # int32 [T, 4] (one 16-byte load a thread) -> its four columns, [T] each
    even, odd = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))  # columns (0, 2) and (1, 3)
    a, c = tl.split(even)
    b, d = tl.split(odd)
    return a, b, c, d


@triton.jit
def _x_regs(x_ptrs, live, EVEN: tl.constexpr, BITS: tl.constexpr):
    # x's elements of the lane's part (32 at 4 bits, 16 at 8) as bf16 pairs, int32 [T] each; x_ptrs [T, 4] the
    # first four pairs'; a dead part (live false) reads zeros
    if EVEN:
        x0, x1, x2, x3 = _quad(tl.load(x_ptrs))
        x4, x5, x6, x7 = _quad(tl.load(x_ptrs + 4))
    else:
        x0, x1, x2, x3 = _quad(tl.load(x_ptrs, mask=live[:, None], other=0))
        x4, x5, x6, x7 = _quad(tl.load(x_ptrs + 4, mask=live[:, None], other=0))
    if BITS == 4:
        if EVEN:
            x8, x9, x10, x11 = _quad(tl.load(x_ptrs + 8))
            x12, x13, x14, x15 = _quad(tl.load(x_ptrs + 12))
        else:
            x8, x9, x10, x11 = _quad(tl.load(x_ptrs + 8, mask=live[:, None], other=0))
            x12, x13, x14, x15 = _quad(tl.load(x_ptrs + 12, mask=live[:, None], other=0))
    else:  # unused
        x8, x9, x10, x11, x12, x13, x14, x15 = x0, x1, x2, x3, x4, x5, x6, x7
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _int_mma_gemv_kernel(
    x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, K_SPLIT, GROUP: tl.constexpr,
    stride_wn: tl.constexpr, stride_sn: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN: tl.constexpr, ROW_BLOCKS: tl.constexpr, WARPS: tl.constexpr,
    PREFETCH_PARTS: tl.constexpr, USE_PDL: tl.constexpr, GATED: tl.constexpr = False, UP: tl.constexpr = 0,
    REDUCE: tl.constexpr = False, M_ROWS: tl.constexpr = 1, TILED: tl.constexpr = False,
):
    # M_ROWS rows of x [M_ROWS, K] (contiguous) against W [N, K] (_gemv_body).
    _gemv_body(x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, K_SPLIT, M_ROWS * N, 1.0, GROUP,
               stride_wn, stride_sn, BITS, HAS_BIAS, SPLIT_K, EVEN, ROW_BLOCKS, WARPS, PREFETCH_PARTS, USE_PDL, GATED,
               UP, REDUCE, False, M_ROWS, TILED)


@triton.jit
def _int_mma_pair_kernel(
    x_ptr, w_ptr, s_ptr, mn_ptr, out_ptr, ws_ptr, cnt_ptr, topk_w_ptr, ids_ptr, map_ptr, N, K, K_SPLIT, top_k,
    num_tokens, GROUP: tl.constexpr, stride_wn: tl.constexpr, stride_sn: tl.constexpr, BITS: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN: tl.constexpr, ROW_BLOCKS: tl.constexpr, WARPS: tl.constexpr, USE_PDL: tl.constexpr,
    GATED: tl.constexpr, UP: tl.constexpr, REDUCE: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_MAP: tl.constexpr,
    SPLIT_MAJOR: tl.constexpr, TILED: tl.constexpr,
):
    # Mixture-of-experts decode: program_id(2) is a (token, expert) pair, which runs _gemv_body on its expert's
    # weight in the stack w [E, N, K] (scales and mins [E, N, groups]), its row of x (GATED: the token's, x
    # [tokens, K]; else the pair's, x [pairs, K]) and its row of out [pairs, N - UP] (SPLIT_MAJOR: row
    # (pair % top_k) tokens + pair // top_k), scaled by its routing weight (MUL_WEIGHT). A K split's partial sums
    # go to ws [SPLIT_K, pairs, N], its arrival counts to cnt [pairs, programs]. A pair of another rank's expert
    # (HAS_MAP: -1 in map) runs nothing and writes nothing. The expert is known only after the PDL wait, so no
    # weight is sent to L2 before it.
    pdl_wait(USE_PDL)
    pair = tl.program_id(2)
    expert = pair_expert(ids_ptr, map_ptr, pair, HAS_MAP)
    if expert < 0:
        return
    row = (pair // top_k) if GATED else pair
    out_row = ((pair % top_k) * num_tokens + pair // top_k) if SPLIT_MAJOR else pair
    scale = tl.load(topk_w_ptr + pair) if MUL_WEIGHT else 1.0
    num_pairs = tl.num_programs(2)
    _gemv_body(x_ptr + row.to(tl.int64) * K, w_ptr + expert * N * stride_wn, s_ptr + expert * N * stride_sn,
               mn_ptr + expert * N * stride_sn, out_ptr, out_ptr + out_row.to(tl.int64) * (N - UP),
               ws_ptr + pair.to(tl.int64) * N, cnt_ptr + pair * tl.num_programs(0), N, K, K_SPLIT,
               num_pairs.to(tl.int64) * N, scale, GROUP, stride_wn, stride_sn, BITS, False, SPLIT_K, EVEN, ROW_BLOCKS,
               WARPS, 0, False, GATED, UP, REDUCE, MUL_WEIGHT, 1, TILED)


@triton.jit
def _gemv_body(
    x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, K_SPLIT, ws_split, scale,
    GROUP: tl.constexpr, stride_wn: tl.constexpr, stride_sn: tl.constexpr, BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    WARPS: tl.constexpr, PREFETCH_PARTS: tl.constexpr, USE_PDL: tl.constexpr, GATED: tl.constexpr, UP: tl.constexpr,
    REDUCE: tl.constexpr, SCALED: tl.constexpr, M_ROWS: tl.constexpr, TILED: tl.constexpr,
):
    # Program = ROW_BLOCKS blocks of 16 channels over K range [pid_k * K_SPLIT, +K_SPLIT) (a multiple of
    # WARPS * PART): warp w takes parts w, w + WARPS, ... of it, and the warps' sums are added at the end. Every
    # tensor holds one element a thread ([T], T = 32 * WARPS; another shape would make Triton move data
    # through shared memory): lane (g, t) of a warp holds words 4t .. 4t + 3 of each part of rows g and g + 8
    # of every block and x at their elements. The MMAs leave a row's F in all four lanes of its g, so lane t
    # scales and stores only block t % ROW_BLOCKS's rows (one load of each scale and min a part, not
    # ROW_BLOCKS). EVEN: K_SPLIT divides K and the output channels fill whole programs.
    # Groups: GROUP a multiple of PART (a part never straddles a group), or PART / GROUP = GPP, 2 or 4 groups a
    # part (4 bits: groups of 64 or 32, GGUF's Q4_0 / Q4_K; 8 bits: 32 or 16, Q8_0 / Q5_K / Q6_K). Lane t's 32
    # (16) elements then lie in one group, t GPP / 4, and B's column c holds x only in the lanes of group
    # cg(c) = (c % 2 + 2 (c // 4 % 2)) % GPP, zero elsewhere: column c sums that group alone, in both F and X. Lane
    # t holds columns 2t and 2t + 1, groups cg(2t) and cg(2t + 1): at GPP 2 both groups of its rows, at GPP 4 two of
    # the four, the other two in lane t ^ 2; the sums of lanes t and t ^ 2 are added at the end, so a block is
    # scaled by lanes t and t ^ 2 and ROW_BLOCKS is 1 or 2.
    # GATED (N = 2 UP weight rows, gate then up): blocks b < ROW_BLOCKS / 2 hold gate rows, the others the up rows
    # UP below them, and the program writes silu(gate) * up of its 16 ROW_BLOCKS / 2 channels. SPLIT_K > 1: the
    # splits' fp32 sums go to ws [SPLIT_K, N] by weight row; REDUCE: the last program of a row block to arrive
    # (counted at cnt_ptr) adds them in split order and writes the output, as the reduce kernel would have.
    # ws_split: elements between two splits' partial sums in ws; SCALED: the output times `scale`.
    # M_ROWS > 1 (2 to 8 rows of x, groups of whole parts, one block a program, no GATED or REDUCE): B's column c
    # holds row c of x (zeros past M_ROWS), so one dequantized A serves every row; lane (g, t) holds rows g and
    # g + 8 of the block for x rows 2t and 2t + 1 (the small groups' two-column assembly), scales both, and stores
    # them (or their partial sums, ws [SPLIT_K, M_ROWS, N]).
    # TILED: the words in tiles of 16 rows x 16 words (int_weight.tile_words), so a part of a block is one tile,
    # 1 KB, that the warp's two loads (rows g, then g + 8) read 512 contiguous bytes each.
    PART: tl.constexpr = 512 // BITS
    PER_WORD: tl.constexpr = 32 // BITS
    GPP: tl.constexpr = PART // GROUP if GROUP < PART else 1  # groups a part
    XROWS: tl.constexpr = M_ROWS > 1
    TWO: tl.constexpr = GPP > 1 or XROWS  # two columns of sums a lane
    OFFSET: tl.constexpr = 1.0 if BITS == 4 else 17.0  # F = sum_k x_k (OFFSET + q_k / 16)
    T: tl.constexpr = 32 * WARPS
    lane, warp, g, t, quad, pid_k, k_begin, k_end = lane_ids(WARPS, K_SPLIT, K)
    OUT_BLOCKS: tl.constexpr = ROW_BLOCKS // 2 if GATED else ROW_BLOCKS  # blocks of output channels
    n_out = N - UP  # output channels (UP is 0 unless GATED)
    first = k_begin + warp * PART  # [T]: the first element of the warp's first part
    block0 = tl.program_id(0) * (16 * OUT_BLOCKS)  # the program's first output channel
    mine = t % ROW_BLOCKS  # [T]: the block whose rows this lane scales and stores
    chan_e = block0 + 16 * (mine % OUT_BLOCKS) + g  # [T]: its channel g (and g + 8)
    half_e = mine // OUT_BLOCKS  # [T]: 1 where the block holds up rows
    x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    x_at = (first + t * (PART // 4)) // 2
    if XROWS:  # lane (g, t): row g of x (K a multiple of 128: rows start on 16-byte lines)
        x_at += g * (K // 2)
    x_ptrs = x_words + tl.multiple_of(x_at, 4)[:, None] + quad  # [T, 4]
    word = tl.multiple_of(first // PER_WORD + 4 * t, 4)[:, None] + quad  # [T, 4]: words 4t .. 4t + 3 of the part
    # Words from row g of a block to row g + 8, and from a part to the warp's next
    HI: tl.constexpr = 128 if TILED else 8 * stride_wn
    W_STEP: tl.constexpr = tiled_step(WARPS * PART // PER_WORD, TILED)  # whole tile columns: never 0
    if EVEN:  # the strides are compile-time: one pointer, the other rows at immediate offsets
        if TILED:  # block 0's tile of the warp's first part: lane (g, t) at row g's words 4t ..
            w_lo = w_ptr + block0.to(tl.int64) * stride_wn + (first // PART * 256 + 4 * lane)[:, None] + quad
        else:  # block 0's rows
            w_lo = w_ptr + (block0 + g).to(tl.int64)[:, None] * stride_wn + word
        s_lo = (chan_e + half_e * UP).to(tl.int64) * stride_sn
        s_hi = s_lo + 8 * stride_sn
    else:  # channels past n_out read channel n_out - 1 and store nothing
        w_lo = word  # unused: the words' offsets come from each part's start
        s_lo = (tl.minimum(chan_e, n_out - 1) + half_e * UP).to(tl.int64) * stride_sn
        s_hi = (tl.minimum(chan_e + 8, n_out - 1) + half_e * UP).to(tl.int64) * stride_sn
    acc_lo = tl.zeros([T], dtype=tl.float32)
    acc_hi = tl.zeros([T], dtype=tl.float32)
    acc_lo_b = tl.zeros([T], dtype=tl.float32)  # M_ROWS > 1: x row 2t + 1's sums
    acc_hi_b = tl.zeros([T], dtype=tl.float32)
    # Whether the lane's x goes to B: its column g is a row of x (M_ROWS > 1) or sums the lane's group (small
    # groups, GPP > 1; always else); and the groups of the part that its columns 2t and 2t + 1 sum
    if XROWS:
        own = g < M_ROWS
    else:
        own = ((g % 2 + 2 * (g // 4 % 2)) % GPP) == (t * GPP // 4)
    col_a = (2 * (t // 2)) % GPP
    col_b = (1 + 2 * (t // 2)) % GPP
    if USE_PDL and PREFETCH_PARTS > 0:  # before the wait: each warp's first parts of every row to L2
        _prefetch_parts(w_ptr, block0, first // PER_WORD, lane, k_end, n_out, stride_wn, ROW_BLOCKS, OUT_BLOCKS, UP,
                        WARPS, PREFETCH_PARTS, PART, TILED)
    pdl_wait(USE_PDL)
    for k0 in range(k_begin, k_end, WARPS * PART):
        start = k0 + warp * PART
        live = start < k_end
        if TWO:  # x only in B's columns of the lane's group (row): the other lanes read zeros
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _x_regs(
                x_ptrs, live & own, False, BITS)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _x_regs(x_ptrs, live, EVEN, BITS)
        if not EVEN:  # a dead part (past k_end) has zero x and reads the words of the split's first part
            start = tl.where(live, start, k_begin)
            word = tl.multiple_of(start // PER_WORD + 4 * t, 4)[:, None] + quad
        group = start // GROUP
        if TWO:
            if BITS == 4:
                xs, xs_b = tl.inline_asm_elementwise(
                    asm=SUM2_ASM_4, constraints=SUM2_CONSTRAINTS_4,
                    args=[x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15],
                    dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
            else:
                xs, xs_b, x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
                    asm=SUM2_ASM_8, constraints=SUM2_CONSTRAINTS_8, args=[x0, x1, x2, x3, x4, x5, x6, x7],
                    dtype=(tl.float32, tl.float32) + (tl.int32,) * 8, is_pure=True, pack=1)
        elif BITS == 4:
            xs = tl.inline_asm_elementwise(
                asm=SUM_ASM_4, constraints=SUM_CONSTRAINTS_4,
                args=[x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15],
                dtype=tl.float32, is_pure=True, pack=1)
        else:  # B's registers: (x_o, x_o+2) of each word
            xs, x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
                asm=SUM_ASM_8, constraints=SUM_CONSTRAINTS_8, args=[x0, x1, x2, x3, x4, x5, x6, x7],
                dtype=(tl.float32,) + (tl.int32,) * 8, is_pure=True, pack=1)
        f_lo = xs
        f_hi = xs
        fb_lo = xs
        fb_hi = xs
        for b in tl.static_range(ROW_BLOCKS):
            if EVEN:  # block b's rows: its 16 channels' offset, and UP further down for an up block
                step = (16 * (b % OUT_BLOCKS) + (b // OUT_BLOCKS) * UP) * stride_wn
                lo = tl.load(w_lo + step)
                hi = tl.load(w_lo + step + HI)
            else:
                chans = block0 + 16 * (b % OUT_BLOCKS) + g
                up_rows = (b // OUT_BLOCKS) * UP
                lo = tl.load(w_ptr + word_offsets((tl.minimum(chans, n_out - 1) + up_rows)[:, None], word, stride_wn,
                                                  TILED))
                hi = tl.load(w_ptr + word_offsets((tl.minimum(chans + 8, n_out - 1) + up_rows)[:, None], word,
                                                  stride_wn, TILED))
            l0, l1, l2, l3 = _quad(lo)
            h0, h1, h2, h3 = _quad(hi)
            bb_lo = xs
            bb_hi = xs
            if TWO and BITS == 4:
                b_lo, b_hi, bb_lo, bb_hi = tl.inline_asm_elementwise(
                    asm=PART2_ASM_4, constraints=PART2_CONSTRAINTS_4,
                    args=[l0, l1, l2, l3, h0, h1, h2, h3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12,
                          x13, x14, x15], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
            elif TWO:
                b_lo, b_hi, bb_lo, bb_hi = tl.inline_asm_elementwise(
                    asm=PART2_ASM_8, constraints=PART2_CONSTRAINTS_8,
                    args=[l0, l1, l2, l3, h0, h1, h2, h3, x0, x1, x2, x3, x4, x5, x6, x7],
                    dtype=(tl.float32,) * 4, is_pure=True, pack=1)
            elif BITS == 4:
                b_lo, b_hi = tl.inline_asm_elementwise(
                    asm=PART_ASM_4, constraints=PART_CONSTRAINTS_4,
                    args=[l0, l1, l2, l3, h0, h1, h2, h3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12,
                          x13, x14, x15], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
            else:
                b_lo, b_hi = tl.inline_asm_elementwise(
                    asm=PART_ASM_8, constraints=PART_CONSTRAINTS_8,
                    args=[l0, l1, l2, l3, h0, h1, h2, h3, x0, x1, x2, x3, x4, x5, x6, x7],
                    dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
            if ROW_BLOCKS == 1:
                f_lo = b_lo
                f_hi = b_hi
                fb_lo = bb_lo
                fb_hi = bb_hi
            else:
                f_lo = tl.where(mine == b, b_lo, f_lo)
                f_hi = tl.where(mine == b, b_hi, f_hi)
                fb_lo = tl.where(mine == b, bb_lo, fb_lo)
                fb_hi = tl.where(mine == b, bb_hi, fb_hi)
        # 16 s (F - OFFSET X) + mn X: the part's sum of x (q s + mn) for each row
        group_a = group + col_a  # the group of column 2t (col_a 0 unless GPP > 1)
        acc_lo = _add_part(acc_lo, s_ptr + s_lo, mn_ptr + s_lo, group_a, f_lo, xs, OFFSET)
        acc_hi = _add_part(acc_hi, s_ptr + s_hi, mn_ptr + s_hi, group_a, f_hi, xs, OFFSET)
        if GPP > 1:  # and column 2t + 1's group
            acc_lo = _add_part(acc_lo, s_ptr + s_lo, mn_ptr + s_lo, group + col_b, fb_lo, xs_b, OFFSET)
            acc_hi = _add_part(acc_hi, s_ptr + s_hi, mn_ptr + s_hi, group + col_b, fb_hi, xs_b, OFFSET)
        if XROWS:  # and x row 2t + 1, same scales
            acc_lo_b = _add_part(acc_lo_b, s_ptr + s_lo, mn_ptr + s_lo, group, fb_lo, xs_b, OFFSET)
            acc_hi_b = _add_part(acc_hi_b, s_ptr + s_hi, mn_ptr + s_hi, group, fb_hi, xs_b, OFFSET)
        x_ptrs += WARPS * PART // 2
        w_lo += W_STEP
    # Lanes t < ROW_BLOCKS hold their rows' sums over their warp's parts: added over the warps, stored once.
    if XROWS:
        _store_xrows(acc_lo, acc_hi, chan_e, 2 * t, n_out, b_ptr, out_ptr, ws_ptr, pid_k, ws_split, HAS_BIAS, SPLIT_K,
                     WARPS, M_ROWS)
        _store_xrows(acc_lo_b, acc_hi_b, chan_e, 2 * t + 1, n_out, b_ptr, out_ptr, ws_ptr, pid_k, ws_split, HAS_BIAS,
                     SPLIT_K, WARPS, M_ROWS)
    else:
        _store_rows(acc_lo, acc_hi, chan_e, half_e, t < ROW_BLOCKS, n_out, b_ptr, out_ptr, ws_ptr, cnt_ptr, pid_k,
                    ws_split, scale, UP, HAS_BIAS, SPLIT_K, WARPS, GATED, OUT_BLOCKS, REDUCE, GPP == 4, SCALED)


@triton.jit
def _add_part(acc, s_row, mn_row, group, f, xs, OFFSET: tl.constexpr):
    # acc plus one part's sum of x (q s + mn) for a row: 16 s (F - OFFSET X) + mn X, with the row's scale and min of
    # `group` (s_row, mn_row: the row's first)
    acc = acc + (tl.load(s_row + group).to(tl.float32) * 16.0) * (f - OFFSET * xs)
    return acc + tl.load(mn_row + group).to(tl.float32) * xs


@triton.jit
def _prefetch_parts(w_ptr, block0, first_word, lane, k_end, n_out, stride_wn: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                    OUT_BLOCKS: tl.constexpr, UP: tl.constexpr, WARPS: tl.constexpr, PREFETCH_PARTS: tl.constexpr,
                    PART: tl.constexpr, TILED: tl.constexpr):
    # Asks for the 64 bytes of each of the program's rows in the warp's first PREFETCH_PARTS parts (first_word
    # [T]: the first part's first word) to be brought to L2, one (row, part) a lane and instruction; no effect on
    # values.
    ROWS: tl.constexpr = 16 * ROW_BLOCKS
    for j in tl.static_range((ROWS * PREFETCH_PARTS + 31) // 32):
        chunk = j * 32 + lane
        block = (chunk % ROWS) // 16
        chan = tl.minimum(block0 + 16 * (block % OUT_BLOCKS) + chunk % 16, n_out - 1)
        row = chan + (block // OUT_BLOCKS) * UP
        at = first_word + (chunk // ROWS) * (WARPS * 16)  # a part is 4 words a lane, 16 a row
        live = (chunk < ROWS * PREFETCH_PARTS) & (at * (PART // 16) < k_end)
        prefetch_l2(w_ptr + word_offsets(row, at, stride_wn, TILED), live)


@triton.jit
def _store_rows(acc_lo, acc_hi, chan_e, half_e, keep_e, n_out, b_ptr, out_ptr, ws_ptr, cnt_ptr, pid_k, ws_split,
                scale, UP, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, WARPS: tl.constexpr, GATED: tl.constexpr,
                OUT_BLOCKS: tl.constexpr, REDUCE: tl.constexpr, PAIRS: tl.constexpr, SCALED: tl.constexpr):
    # acc_lo, acc_hi, chan_e, half_e and keep_e [T] (thread = warp * 32 + lane; all but the sums the same in every
    # warp) -> the sums of acc_lo and acc_hi over the warps, [32, 2] (lane, row g or g + 8): the output where K is
    # not split, else the split's partial sums into ws at their weight rows and, with REDUCE, the output from the
    # last split of the row block to arrive. PAIRS: lanes t and t ^ 2 each hold two of a row's four groups; both
    # get the whole sum.
    both = tl.reshape(tl.join(acc_lo, acc_hi), [WARPS, 32, 2])
    y = tl.sum(both, axis=0)  # [32, 2]
    if PAIRS:
        pair = tl.sum(tl.reshape(y, [8, 2, 2, 2]), axis=1)  # (g, t % 2, row): lanes t and t ^ 2 added
        y = tl.reshape(tl.permute(tl.join(pair, pair), (0, 3, 1, 2)), [32, 2])
    chan = tl.max(tl.reshape(chan_e, [WARPS, 32]), axis=0)[:, None] + 8 * tl.arange(0, 2)[None, :]
    rows = chan + tl.max(tl.reshape(half_e, [WARPS, 32]), axis=0)[:, None] * UP  # weight rows
    keep = tl.max(tl.reshape(keep_e.to(tl.int32), [WARPS, 32]), axis=0)[:, None] > 0
    mask = keep & (chan < n_out)
    if SPLIT_K == 1:
        _store_output(y, chan, rows, mask, b_ptr, out_ptr, scale, HAS_BIAS, GATED, OUT_BLOCKS, SCALED)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * ws_split + rows, y, mask=mask)
        if REDUCE:
            # Count in (release: every thread's partial sums above first); the last to arrive adds them all.
            tl.debug_barrier()
            count = cnt_ptr + tl.program_id(0)
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                tl.store(count, 0)  # zero again for the next launch (which counts only after its PDL wait)
                total = tl.load(ws_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
                for i in tl.static_range(1, SPLIT_K):
                    total += tl.load(ws_ptr + i * ws_split + rows, mask=mask, other=0.0, cache_modifier=".cg")
                _store_output(total, chan, rows, mask, b_ptr, out_ptr, scale, HAS_BIAS, GATED, OUT_BLOCKS, SCALED)


@triton.jit
def _store_xrows(acc_lo, acc_hi, chan_e, xrow_e, n_out, b_ptr, out_ptr, ws_ptr, pid_k, ws_split, HAS_BIAS: tl.constexpr,
                 SPLIT_K: tl.constexpr, WARPS: tl.constexpr, M_ROWS: tl.constexpr):
    # Several rows of x: acc_lo, acc_hi [T] the sums of channels chan_e and chan_e + 8 for x row xrow_e (a lane's),
    # added over the warps and stored at out [M_ROWS, n_out] (or the split's partial sums at ws [SPLIT_K, M_ROWS,
    # n_out]); rows past M_ROWS and channels past n_out are not stored.
    y = tl.sum(tl.reshape(tl.join(acc_lo, acc_hi), [WARPS, 32, 2]), axis=0)  # [32, 2]
    chan = tl.max(tl.reshape(chan_e, [WARPS, 32]), axis=0)[:, None] + 8 * tl.arange(0, 2)[None, :]
    xrow = tl.max(tl.reshape(xrow_e, [WARPS, 32]), axis=0)[:, None]
    mask = (xrow < M_ROWS) & (chan < n_out)
    at = xrow * n_out + chan
    if SPLIT_K == 1:
        if HAS_BIAS:
            y = y + tl.load(b_ptr + chan, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * ws_split + at, y, mask=mask)


@triton.jit
def _store_output(y, chan, rows, mask, b_ptr, out_ptr, scale, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                  OUT_BLOCKS: tl.constexpr, SCALED: tl.constexpr):
    # The rows' full sums y [32, 2] (lane, g or g + 8) plus the bias (SCALED: times scale), rounded to the output
    # dtype at channels chan where mask; GATED: silu(gate) * up, each rounded where the unfused GEMV + silu_and_mul
    # round it.
    out_ty = out_ptr.dtype.element_ty
    if HAS_BIAS:
        y = y + tl.load(b_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        gate, up = _gate_up(y, OUT_BLOCKS)
        chan, _ = _gate_up(chan, OUT_BLOCKS)
        mask, _ = _gate_up(mask.to(tl.int32), OUT_BLOCKS)
        gate = gate.to(out_ty).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32)  # F.silu rounds before the multiply
        tl.store(out_ptr + chan, (silu * up.to(out_ty).to(tl.float32)).to(out_ty), mask=mask > 0)
    else:
        if SCALED:  # a routing weight (the MoE down projection's pairs)
            y = y * scale
        tl.store(out_ptr + chan, y.to(out_ty), mask=mask)


@triton.jit
def _gate_up(v, OUT_BLOCKS: tl.constexpr):
    # [32, 2] by (lane 4g + t, row g or g + 8) -> the gate lanes' and the up lanes' values, [8, 2, 2] each, paired
    # by channel. Lane t holds block t % ROW_BLOCKS: at 2 blocks t % 2 tells gate (0) from up (1), and lanes t and
    # t + 2 hold the same; at 4 blocks t // 2 does, and t % 2 is the 16-channel block.
    v4 = tl.reshape(v, [8, 2, 2, 2])  # (g, t // 2, t % 2, g or g + 8)
    if OUT_BLOCKS == 1:
        v4 = tl.permute(v4, (0, 1, 3, 2))
    else:
        v4 = tl.permute(v4, (0, 2, 3, 1))
    return tl.split(v4)


def groups_a_part(bits: int, group_size: int) -> int:
    """Groups in a part (K elements a warp multiplies at a time): 1 where a group holds whole parts, else 2 or 4
    (4 bits: groups of 64 or 32; 8 bits: 32 or 16); 0 where the GEMV takes no such groups."""
    part = part_elements(bits)
    if group_size % part == 0:
        return 1
    return part // group_size if group_size in (part // 2, part // 4) else 0


def mma_gemv_fits(m: int, k: int, bits: int, group_size: int) -> bool:
    """Whether the tensor-core GEMV takes this product: one row, 4 or 8 bits, K whole parts, and groups of whole
    parts or a half or a quarter of one."""
    return m == 1 and bits in (4, 8) and k % part_elements(bits) == 0 and groups_a_part(bits, group_size) > 0


def mma_gemv_config(n: int, k: int, bits: int, sms: int, gated: bool = False, group_size: int = 128,
                    m_rows: int = 1) -> dict[str, int]:
    """Tile from the shape alone (graph-safe), 4 warps splitting K in a program: the fewest 16-row blocks a program
    that keep the grid within 8 programs an SM, then K split over programs (fp32 partial sums, reduced after or by
    the RMSNorm that follows) while that stays within 8 an SM, each split at least two parts a warp. On an H200
    (scripts/bench_int_weight.py --sweep, Llama-3-8B projections at 4 bits) the best tiles gave 6-8 programs of 4
    warps an SM: fewer leave too few loads in flight, more cost more partial sums; 8 warps a program were slower
    at every 8B shape. Where K stays whole on one block and a warp would take 16 parts or more, though, 4 bits
    take 2 blocks of 8 warps (Llama-3-70B's qkv, 10240 x 8192: 18.7 us against 25.0 on an H200,
    kernels-int-weight-70b-tiles-sweep.json). (sm_90 ptxas, K 4096, the K loop per 4-bit weight: 1.94
    instructions at 1 block, 1.59 at 2, 1.37 at 4; 54, 66 and 72 registers, no spills; scripts/sass_int_gemv.py.)
    gated (n gate then up rows): at least 2 blocks, a gate block and its up block (the Llama-3-8B gate/up
    projection's tile either way). Four groups a part (group_size a quarter of one) take at most 2 blocks.
    m_rows > 1 (rows of x): one block a program (a lane holds the block's rows for two rows of x), the K split
    chosen for that many programs."""
    warps, parts, most = 4, k // part_elements(bits), PROGRAMS_PER_SM * sms
    blocks = next((b for b in ((2,) if gated else (1, 2)) if triton.cdiv(n, 16 * b) <= most), 4)
    if m_rows > 1:
        blocks = 1
    if groups_a_part(bits, group_size) == 4:
        blocks = min(blocks, 2)
    programs, split_k = triton.cdiv(n, 16 * blocks), 1
    while 2 * programs * split_k <= most and split_k < 8 and parts >= 4 * split_k * warps:
        split_k *= 2
    if bits == 4 and m_rows == 1 and blocks == 1 and split_k == 1 and parts >= 16 * warps:
        blocks, warps = 2, 8  # a long K left whole (Llama-3-70B's qkv): twice the blocks a warp, K over 8 warps
    return {"ROW_BLOCKS": blocks, "SPLIT_K": split_k, "num_warps": warps}


def mma_gemv_constexprs(n: int, k: int, bits: int, group_size: int, cfg: dict[str, int], has_bias: bool,
                        use_pdl: int, gated: bool = False, reduce: bool = False, m_rows: int = 1,
                        tiled: bool = False) -> dict:
    """The kernel's compile-time arguments for a config (also scripts/sass_int_gemv.py's); the strides are those
    of a contiguous IntWeight (words K bits / 32, scales K / group_size a row; tiled: its words in tiles,
    int_weight.tile_words). gated: n rows, gate then up, give
    n / 2 outputs silu(gate) * up (ROW_BLOCKS 2 or 4); reduce: a K split adds its partial sums in the kernel;
    m_rows: rows of x (more than one: up to MMA_MAX_ROWS, one block a program, groups of whole parts, neither
    gated nor reduce)."""
    warps, blocks = cfg["num_warps"], cfg["ROW_BLOCKS"]
    if m_rows > 1 and (m_rows > MMA_MAX_ROWS or blocks != 1 or gated or reduce
                       or groups_a_part(bits, group_size) != 1):
        raise ValueError(f"{m_rows} rows of x take 1 row block, groups of whole parts, no gate and no folded split")
    if gated and (blocks not in (2, 4) or n % 2):
        raise ValueError(f"the gated GEMV takes 2 or 4 row blocks and an even number of rows, got {blocks} and {n}")
    if groups_a_part(bits, group_size) == 4 and blocks > 2:
        raise ValueError(f"groups of {group_size} at {bits} bits take 1 or 2 row blocks a program, got {blocks}")
    k_split = mma_k_split(k, bits, cfg["SPLIT_K"], warps)
    channels = 16 * (blocks // 2 if gated else blocks)  # output channels a program
    return dict(GROUP=group_size, stride_wn=k * bits // WORD_BITS, stride_sn=k // group_size, BITS=bits,
                HAS_BIAS=has_bias, SPLIT_K=triton.cdiv(k, k_split),
                EVEN=k % k_split == 0 and (n // 2 if gated else n) % channels == 0, ROW_BLOCKS=blocks,
                WARPS=warps, PREFETCH_PARTS=prefetch_parts() if use_pdl else 0, USE_PDL=use_pdl, GATED=gated,
                UP=n // 2 if gated else 0, REDUCE=reduce, M_ROWS=m_rows, TILED=tiled)


def prefetch_parts() -> int:
    """Parts of each row a warp sends to L2 before the PDL wait (TANDEM_INT_MMA_PREFETCH_PARTS, default 2;
    0: none), read per launch."""
    return int(os.environ.get("TANDEM_INT_MMA_PREFETCH_PARTS", "2"))


def mma_k_split(k: int, bits: int, split_k: int, warps: int) -> int:
    """Elements of K a program takes: whole rounds of one part a warp."""
    step = part_elements(bits) * warps
    return triton.cdiv(triton.cdiv(k, step), split_k) * step


@functools.lru_cache(maxsize=None)
def _has_bf16_mma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 8


def mma_max_rows() -> int:
    """Rows of x the tensor-core GEMV takes: up to MMA_MAX_ROWS, or TANDEM_INT_MMA_MAX_ROWS (1: one row only, the
    tile GEMM for more; read per call: a CUDA graph keeps what its capture chose). At 2 to 8 rows it runs 1.3-2.4x
    the tile GEMM on the 8B shape's projections (benchmarks/results/h200/kernels-int-weight-rows.json)."""
    return min(int(os.environ.get("TANDEM_INT_MMA_MAX_ROWS", str(MMA_MAX_ROWS))), MMA_MAX_ROWS)


def _takes(x: torch.Tensor, weight: IntWeight) -> bool:
    """What both GEMVs need of x and of a weight (or a stack of experts): bf16 x on a CUDA GPU of compute capability
    8.0 or more (bf16 mma.sync), bf16 scales, K and groups the kernel takes (small groups unless
    TANDEM_INT_MMA_SMALL_GROUPS=0, read per call)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and weight.scales.dtype == torch.bfloat16
            and mma_gemv_fits(1, weight.shape[1], weight.bits, weight.group_size)
            and (groups_a_part(weight.bits, weight.group_size) == 1
                 or os.environ.get("TANDEM_INT_MMA_SMALL_GROUPS", "1") != "0")
            and _has_bf16_mma(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def use_mma_gemv(x: torch.Tensor, weight: IntWeight) -> bool:
    """The tensor-core GEMV for this product: bf16 x on a CUDA GPU of compute capability 8.0 or more (bf16
    mma.sync), a shape it takes (one row; up to mma_max_rows() rows where the groups are whole parts), x
    contiguous with 16-byte aligned rows (read as int32 pairs, 16 bytes a load), a contiguous IntWeight (its
    strides are compile-time), and TANDEM_INT_GEMV_MMA not 0 (read per call: a CUDA graph keeps what its capture
    chose)."""
    m = x.shape[0]
    rows_ok = m == 1 or (1 < m <= mma_max_rows() and groups_a_part(weight.bits, weight.group_size) == 1
                         and x.is_contiguous())
    return rows_ok and os.environ.get("TANDEM_INT_GEMV_MMA", "1") != "0" and reads_dense(x, weight)


def reads_dense(x: torch.Tensor, weight: IntWeight) -> bool:
    """What the tensor-core kernels of one weight need of its layout and of x: x's rows of unit stride, 16-byte
    aligned (read as int32 pairs, 16 bytes a load), a contiguous IntWeight (its strides are compile-time), and
    _takes."""
    groups = weight.scales.shape[1]
    return (x.stride(1) == 1 and x.data_ptr() % 16 == 0 and weight.words.stride(0) == weight.words.shape[1]
            and weight.scales.stride(0) == groups and weight.mins.stride(0) == groups and _takes(x, weight))


def fold_reduce() -> bool:
    """Whether a K split the next kernel does not add up (no `defer`) is added up by the GEMV's own last program of
    each row block (the default; TANDEM_INT_MMA_FOLD_REDUCE=0: by the split-K reduce kernel after it), read per
    call: a CUDA graph keeps what its capture chose. A gated GEMV always adds its splits itself."""
    return os.environ.get("TANDEM_INT_MMA_FOLD_REDUCE", "1") != "0"


def _split_counters(device: torch.device, programs: int) -> torch.Tensor:
    """Arrival counts of a folded K split, one int32 per row block, zero between launches (the program that adds the
    splits resets its own). One buffer per device (persistent_state): kernels that use it run one after another
    in the stream and count only after their PDL wait, when the one before has finished."""
    return persistent_state("the int GEMV's split counters", device, programs,
                            lambda n: torch.zeros(n, dtype=torch.int32, device=device), 4096)


def int_mma_gemv(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None, defer: bool = False,
                 config: dict[str, int] | None = None, gated: bool = False) -> torch.Tensor | PartialSums:
    """x W^T + b for bf16 rows x [M, K] (use_mma_gemv holds) on the tensor cores; grid and workspace from the
    shape alone (captures in CUDA graphs). With `defer` (and TANDEM_DEFER_REDUCE not 0) a K split hands its
    fp32 partial sums on; otherwise the kernel adds them itself (fold_reduce; several rows: the reduce kernel).
    gated (weight rows gate then up, one row): silu(gate) * up, [1, N / 2], in the same kernel. config: overrides
    mma_gemv_config's entries (benchmarks, tests)."""
    n, k = weight.shape
    bits, m = weight.bits, x.shape[0]
    if gated and (n % 2 or m > 1):
        raise ValueError(f"the gated GEMV needs one row and an even number of weight rows (gate then up), got {m} "
                         f"and {n}")
    out = torch.empty(m, n // 2 if gated else n, dtype=x.dtype, device=x.device)
    cfg = {**mma_gemv_config(n, k, bits, device_sms(x.device), gated, weight.group_size, m), **(config or {})}
    pdl = use_pdl(x.device)
    k_split = mma_k_split(k, bits, cfg["SPLIT_K"], cfg["num_warps"])
    split_k = triton.cdiv(k, k_split)  # whole rounds a split can leave fewer splits than asked for
    deferred = defers(defer) and not gated
    reduce = split_k > 1 and not deferred and (gated or fold_reduce()) and m == 1
    flags = mma_gemv_constexprs(n, k, bits, weight.group_size, cfg, bias is not None, pdl, gated, reduce, m,
                                weight.tiled)
    ws = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    channels = 16 * (cfg["ROW_BLOCKS"] // 2 if gated else cfg["ROW_BLOCKS"])
    programs = triton.cdiv(out.shape[1], channels)
    counts = _split_counters(x.device, programs) if reduce else ws
    w, scales = weight.words, weight.scales
    _int_mma_gemv_kernel[(programs, split_k)](
        x, w, scales, weight.mins, bias if bias is not None else scales, out, ws, counts, n, k, k_split, **flags,
        num_warps=cfg["num_warps"], num_stages=1, launch_pdl=bool(pdl))
    if reduce:
        return out
    return finish_split(ws, out, bias, split_k, deferred)


def use_mma_pair_gemv(x: torch.Tensor, weight: IntWeight) -> bool:
    """use_mma_gemv for a stack of experts [E, N, K] (contiguous: the kernel steps from expert to expert by N rows)
    and the pairs' rows of x [rows, K] (contiguous)."""
    n, groups = weight.words.shape[1], weight.scales.shape[-1]
    return (x.is_contiguous() and weight.words.is_contiguous() and weight.scales.stride() == (n * groups, groups, 1)
            and weight.mins.stride() == weight.scales.stride() and _takes(x, weight))


def int_mma_pair_gemv(
    x: torch.Tensor,  # [tokens, K] (gated) or [pairs, K], bf16, contiguous
    weight: IntWeight,  # a stack of experts: words [E, N, K * bits / 32], scales and mins [E, N, groups]
    out: torch.Tensor,  # [pairs, N / 2] (gated) or [pairs, N], contiguous
    topk_ids: torch.Tensor,  # [pairs] int32, global expert ids
    top_k: int,
    gated: bool,
    expert_map: torch.Tensor | None = None,  # global -> local expert id, -1 for another rank's
    topk_weights: torch.Tensor | None = None,  # [pairs] fp32: scales each output row (not with gated)
    split_major: bool = False,  # out row of pair p: (p % top_k) * tokens + p // top_k
    config: dict[str, int] | None = None,
) -> None:
    """The mixture-of-experts decode (a few tokens, each pair's rows apart) on the tensor-core GEMV: out[pair] = the
    pair's row of x against its expert's weight (gated: silu(gate) * up of the token's row), one grid for all
    pairs. The tile comes from the shape and the pair count alone (graph-safe): mma_gemv_config as if each pair
    had its share of the SMs. A K split is added by its last program (never deferred)."""
    n, k = weight.shape
    num_pairs = topk_ids.shape[0]
    if gated and topk_weights is not None:
        raise ValueError("the gated pair GEMV writes silu(gate) * up unscaled")
    if out.shape[0] != num_pairs or out.shape[1] != (n // 2 if gated else n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{num_pairs}, {n // 2 if gated else n}], got {tuple(out.shape)}")
    bits = weight.bits
    sms = max(device_sms(x.device) // max(num_pairs, 1), 1)
    cfg = {**mma_gemv_config(n, k, bits, sms, gated, weight.group_size), **(config or {})}
    k_split = mma_k_split(k, bits, cfg["SPLIT_K"], cfg["num_warps"])
    split_k = triton.cdiv(k, k_split)
    flags = mma_gemv_constexprs(n, k, bits, weight.group_size, cfg, False, 0, gated, split_k > 1,
                                tiled=weight.tiled)
    for unused in ("HAS_BIAS", "PREFETCH_PARTS", "M_ROWS"):
        flags.pop(unused)
    pdl = use_pdl(x.device)
    flags["USE_PDL"] = pdl
    channels = 16 * (cfg["ROW_BLOCKS"] // 2 if gated else cfg["ROW_BLOCKS"])
    programs = triton.cdiv(out.shape[1], channels)
    ws = torch.empty(split_k, num_pairs, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    counts = _split_counters(x.device, programs * num_pairs) if split_k > 1 else ws
    _int_mma_pair_kernel[(programs, split_k, num_pairs)](
        x, weight.words, weight.scales, weight.mins, out, ws, counts,
        topk_weights if topk_weights is not None else out, topk_ids,
        expert_map if expert_map is not None else topk_ids, n, k, k_split, top_k, num_pairs // top_k, **flags,
        MUL_WEIGHT=topk_weights is not None, HAS_MAP=expert_map is not None, SPLIT_MAJOR=split_major,
        num_warps=cfg["num_warps"], num_stages=1, launch_pdl=bool(pdl))
