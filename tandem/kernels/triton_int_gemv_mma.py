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
from tandem.kernels.triton_launch import device_sms, pdl_wait, prefetch_l2, use_pdl
from tandem.kernels.triton_quant import finish_split


PROGRAMS_PER_SM = 8  # the most programs of 4 warps a GEMV's grid gives each SM (mma_gemv_config)


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


def _part_asm(bits: int) -> str:
    # One part of rows g and g + 8 of a block: words $2-$5 and $6-$9 (4t .. 4t + 3 of the part), then B's
    # registers; out: F of row g ($0) and g + 8 ($1) over the part, chained from zero over 8 MMAs.
    # 4 bits: pair p of a word (its elements 2p and 2p + 1, bits 4p and 4p + 16: int_weight.NIBBLE_ORDER) is
    #   (word >> 4p - 3) & 0x00780078 | 0x3F803F80 = 1 + q / 16; MMA j takes pairs 2 (j % 2) and 2 (j % 2) + 1
    #   as a0 and a2 and x's pairs 2j and 2j + 1 ($10 + 2j, $11 + 2j): F = sum x (1 + q / 16).
    # 8 bits: byte i of a word is element i; (word >> 8o - 3) & 0x00780078 | 0x3F803F80 holds the low nibbles of
    #   elements o and o + 2 (1 + lo / 16), (word >> 8o + 1) & 0x00780078 | 0x41804180 their high nibbles
    #   (16 + hi); MMA j takes o = j % 2, the low nibbles as a0, the high as a2, and B = (x_o, x_o+2) of the word
    #   in both ($10 + j): F = sum x (17 + q / 16).
    lines = ["{", ".reg .b32 m, lo, hi, s, a0, a1, a2, a3;", ".reg .f32 d1, d3;", "mov.b32 m, 0x00780078;",
             "mov.b32 lo, 0x3F803F80;", f"mov.b32 hi, {'0x3F803F80' if bits == 4 else '0x41804180'};",
             "mov.f32 $0, 0f00000000;", "mov.f32 $1, 0f00000000;", "mov.f32 d1, 0f00000000;",
             "mov.f32 d3, 0f00000000;"]
    for j in range(8):
        row_g, row_h, shift = f"${2 + j // 2}", f"${6 + j // 2}", 8 * (j % 2)
        for reg, word, sh, magic in (("a0", row_g, shift - 3, "lo"), ("a2", row_g, shift + 1, "hi"),
                                     ("a1", row_h, shift - 3, "lo"), ("a3", row_h, shift + 1, "hi")):
            move = f"shr.u32 s, {word}, {sh};" if sh > 0 else f"shl.b32 s, {word}, {-sh};"
            lines += [move, f"lop3.b32 {reg}, s, m, {magic}, 0xea;"]
        b0, b1 = (10 + 2 * j, 11 + 2 * j) if bits == 4 else (10 + j, 10 + j)
        lines.append(_MMA.replace("B0", f"${b0}").replace("B1", f"${b1}"))
    return "\n".join(lines + ["}"])


def _sum_asm(bits: int) -> str:
    # X = sum_k x_k over the part by MMAs with A all ones (bf16 1.0 pairs), two chains for the latency; the
    # part's contribution to row r is 16 s (F - OFFSET X) + mn X. In: x's registers (16 at 4 bits, $1-$16; 8 at 8
    # bits, $9-$16); out: X ($0) and, at 8 bits, B's registers of the words ($1-$8: (x_o, x_o+2) of each).
    regs = 16 if bits == 4 else 8
    first = 1 if bits == 4 else 9
    lines = ["{", ".reg .b32 one;", ".reg .f32 e<8>;", "mov.b32 one, 0x3F803F80;"]
    lines += [f"mov.f32 e{i}, 0f00000000;" for i in range(8)]
    for j in range(regs // 2):
        c = "e0, e1, e2, e3" if j % 2 == 0 else "e4, e5, e6, e7"
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c}}}, {{one, one, one, one}}, "
                     f"{{${first + 2 * j}, ${first + 2 * j + 1}}}, {{{c}}};")
    if bits == 8:  # x pairs (x0, x1), (x2, x3) of a word -> (x0, x2) and (x1, x3)
        for w in range(4):
            a, b = f"${first + 2 * w}", f"${first + 2 * w + 1}"
            lines += [f"prmt.b32 ${1 + 2 * w}, {a}, {b}, 0x5410;", f"prmt.b32 ${2 + 2 * w}, {a}, {b}, 0x7632;"]
    return "\n".join(lines + ["add.f32 $0, e0, e4;", "}"])


PART_ASM_4 = tl.constexpr(_part_asm(4))
PART_ASM_8 = tl.constexpr(_part_asm(8))
SUM_ASM_4 = tl.constexpr(_sum_asm(4))
SUM_ASM_8 = tl.constexpr(_sum_asm(8))
PART_CONSTRAINTS_4 = tl.constexpr("=f,=f," + ",".join(["r"] * 24))
PART_CONSTRAINTS_8 = tl.constexpr("=f,=f," + ",".join(["r"] * 16))
SUM_CONSTRAINTS_4 = tl.constexpr("=f," + ",".join(["r"] * 16))
SUM_CONSTRAINTS_8 = tl.constexpr("=f," + ",".join(["=r"] * 8) + "," + ",".join(["r"] * 8))


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
    x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, ws_ptr, N, K, K_SPLIT, GROUP: tl.constexpr,
    stride_wn: tl.constexpr, stride_sn: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN: tl.constexpr, ROW_BLOCKS: tl.constexpr, WARPS: tl.constexpr,
    PREFETCH_PARTS: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program = ROW_BLOCKS blocks of 16 channels over K range [pid_k * K_SPLIT, +K_SPLIT) (a multiple of
    # WARPS * PART): warp w takes parts w, w + WARPS, ... of it, and the warps' sums are added at the end. Every
    # tensor holds one element a thread ([T], T = 32 * WARPS; another shape would make Triton move data
    # through shared memory): lane (g, t) of a warp holds words 4t .. 4t + 3 of each part of rows g and g + 8
    # of every block and x at their elements. The MMAs leave a row's F in all four lanes of its g, so lane t
    # scales and stores only block t % ROW_BLOCKS's rows (one load of each scale and min a part, not
    # ROW_BLOCKS). A part never straddles a group (GROUP is a multiple of PART). EVEN: K_SPLIT divides K and N
    # fills whole programs.
    PART: tl.constexpr = 512 // BITS
    PER_WORD: tl.constexpr = 32 // BITS
    OFFSET: tl.constexpr = 1.0 if BITS == 4 else 17.0  # F = sum_k x_k (OFFSET + q_k / 16)
    T: tl.constexpr = 32 * WARPS
    tid = tl.arange(0, T)
    lane = tid % 32
    warp = tid // 32
    g = lane // 4
    t = lane % 4
    quad = tl.arange(0, 4)[None, :]
    pid_k = tl.program_id(1)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    first = k_begin + warp * PART  # [T]: the first element of the warp's first part
    block0 = tl.program_id(0) * (16 * ROW_BLOCKS)
    mine = t % ROW_BLOCKS  # [T]: the block whose rows this lane scales and stores
    row_e = block0 + 16 * mine + g
    x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    x_ptrs = x_words + tl.multiple_of((first + t * (PART // 4)) // 2, 4)[:, None] + quad  # [T, 4]
    word = tl.multiple_of(first // PER_WORD + 4 * t, 4)[:, None] + quad  # [T, 4]: words 4t .. 4t + 3 of the part
    if EVEN:  # the strides are compile-time: one pointer, the other rows at immediate offsets
        w_lo = w_ptr + (block0 + g).to(tl.int64)[:, None] * stride_wn + word  # block 0; block b: + 16 b rows
        s_lo = row_e.to(tl.int64) * stride_sn
        s_hi = s_lo + 8 * stride_sn
    else:  # rows past N read row N - 1 and store nothing
        w_lo = word  # unused: the words' offsets come from each part's start
        s_lo = tl.minimum(row_e, N - 1).to(tl.int64) * stride_sn
        s_hi = tl.minimum(row_e + 8, N - 1).to(tl.int64) * stride_sn
    block_step = 16 * stride_wn
    acc_lo = tl.zeros([T], dtype=tl.float32)
    acc_hi = tl.zeros([T], dtype=tl.float32)
    if USE_PDL and PREFETCH_PARTS > 0:  # before the wait: each warp's first parts of every row to L2
        _prefetch_parts(w_ptr, block0, first // PER_WORD, lane, k_end, N, stride_wn, ROW_BLOCKS, WARPS,
                        PREFETCH_PARTS, PART)
    pdl_wait(USE_PDL)
    for k0 in range(k_begin, k_end, WARPS * PART):
        start = k0 + warp * PART
        live = start < k_end
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _x_regs(x_ptrs, live, EVEN, BITS)
        if not EVEN:  # a dead part (past k_end) has zero x and reads the words of the split's first part
            start = tl.where(live, start, k_begin)
            word = tl.multiple_of(start // PER_WORD + 4 * t, 4)[:, None] + quad
        group = start // GROUP
        if BITS == 4:
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
        for b in tl.static_range(ROW_BLOCKS):
            if EVEN:
                lo = tl.load(w_lo + b * block_step)
                hi = tl.load(w_lo + b * block_step + 8 * stride_wn)
            else:
                rows = block0 + 16 * b + g
                lo = tl.load(w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn + word)
                hi = tl.load(w_ptr + tl.minimum(rows + 8, N - 1).to(tl.int64)[:, None] * stride_wn + word)
            l0, l1, l2, l3 = _quad(lo)
            h0, h1, h2, h3 = _quad(hi)
            if BITS == 4:
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
            else:
                f_lo = tl.where(mine == b, b_lo, f_lo)
                f_hi = tl.where(mine == b, b_hi, f_hi)
        # 16 s (F - OFFSET X) + mn X: the part's sum of x (q s + mn) for each row
        acc_lo = acc_lo + (tl.load(s_ptr + s_lo + group).to(tl.float32) * 16.0) * (f_lo - OFFSET * xs)
        acc_lo = acc_lo + tl.load(mn_ptr + s_lo + group).to(tl.float32) * xs
        acc_hi = acc_hi + (tl.load(s_ptr + s_hi + group).to(tl.float32) * 16.0) * (f_hi - OFFSET * xs)
        acc_hi = acc_hi + tl.load(mn_ptr + s_hi + group).to(tl.float32) * xs
        x_ptrs += WARPS * PART // 2
        w_lo += WARPS * PART // PER_WORD
    # Lanes t < ROW_BLOCKS hold their rows' sums over their warp's parts: added over the warps, stored once.
    _store_rows(acc_lo, acc_hi, row_e, t < ROW_BLOCKS, N, b_ptr, out_ptr, ws_ptr, pid_k, HAS_BIAS, SPLIT_K, WARPS)


@triton.jit
def _prefetch_parts(w_ptr, block0, first_word, lane, k_end, N, stride_wn: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                    WARPS: tl.constexpr, PREFETCH_PARTS: tl.constexpr, PART: tl.constexpr):
    # Asks for the 64 bytes of each of the program's rows in the warp's first PREFETCH_PARTS parts (first_word
    # [T]: the first part's first word) to be brought to L2, one (row, part) a lane and instruction; no effect on
    # values.
    ROWS: tl.constexpr = 16 * ROW_BLOCKS
    for j in tl.static_range((ROWS * PREFETCH_PARTS + 31) // 32):
        chunk = j * 32 + lane
        row = tl.minimum(block0 + chunk % ROWS, N - 1)
        at = first_word + (chunk // ROWS) * (WARPS * 16)  # a part is 4 words a lane, 16 a row
        live = (chunk < ROWS * PREFETCH_PARTS) & (at * (PART // 16) < k_end)
        prefetch_l2(w_ptr + row.to(tl.int64) * stride_wn + at, live)


@triton.jit
def _store_rows(acc_lo, acc_hi, rows, keep, N, b_ptr, out_ptr, ws_ptr, pid_k, HAS_BIAS: tl.constexpr,
                SPLIT_K: tl.constexpr, WARPS: tl.constexpr):
    # acc_lo, acc_hi, rows and keep [T] (thread = warp * 32 + lane; rows and keep the same in every warp) -> the
    # sums of acc_lo and acc_hi over the warps, stored at rows and rows + 8 where keep
    both = tl.reshape(tl.join(acc_lo, acc_hi), [WARPS, 32, 2])
    y = tl.sum(both, axis=0)  # [32, 2]
    rows = tl.max(tl.reshape(rows, [WARPS, 32]), axis=0)[:, None] + 8 * tl.arange(0, 2)[None, :]
    keep = tl.max(tl.reshape(keep.to(tl.int32), [WARPS, 32]), axis=0)[:, None] > 0
    mask = keep & (rows < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y = y + tl.load(b_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * N + rows, y, mask=mask)


def mma_gemv_fits(m: int, k: int, bits: int, group_size: int) -> bool:
    """Whether the tensor-core GEMV takes this product: one row, 4 or 8 bits, K and the groups whole parts."""
    return m == 1 and bits in (4, 8) and k % part_elements(bits) == 0 and group_size % part_elements(bits) == 0


def mma_gemv_config(n: int, k: int, bits: int, sms: int) -> dict[str, int]:
    """Tile from the shape alone (graph-safe), 4 warps splitting K in a program: the fewest 16-row blocks a program
    that keep the grid within 8 programs an SM, then K split over programs (fp32 partial sums, reduced after or by
    the RMSNorm that follows) while that stays within 8 an SM, each split at least two parts a warp. On an H200
    (scripts/bench_int_weight.py --sweep, Llama-3-8B projections at 4 bits) the best tiles gave 6-8 programs of 4
    warps an SM: fewer leave too few loads in flight, more cost more partial sums; 8 warps a program were slower
    at every shape. (sm_90 ptxas, K 4096, the K loop per 4-bit weight: 1.94 instructions at 1 block, 1.59 at 2,
    1.37 at 4; 54, 66 and 72 registers, no spills; scripts/sass_int_gemv.py.)"""
    warps, parts, most = 4, k // part_elements(bits), PROGRAMS_PER_SM * sms
    blocks = next((b for b in (1, 2) if triton.cdiv(n, 16 * b) <= most), 4)
    programs, split_k = triton.cdiv(n, 16 * blocks), 1
    while 2 * programs * split_k <= most and split_k < 8 and parts >= 4 * split_k * warps:
        split_k *= 2
    return {"ROW_BLOCKS": blocks, "SPLIT_K": split_k, "num_warps": warps}


def mma_gemv_constexprs(n: int, k: int, bits: int, group_size: int, cfg: dict[str, int], has_bias: bool,
                        use_pdl: int) -> dict:
    """The kernel's compile-time arguments for a config (also scripts/sass_int_gemv.py's); the strides are those
    of a contiguous IntWeight (words K bits / 32, scales K / group_size a row)."""
    warps = cfg["num_warps"]
    k_split = mma_k_split(k, bits, cfg["SPLIT_K"], warps)
    return dict(GROUP=group_size, stride_wn=k * bits // WORD_BITS, stride_sn=k // group_size, BITS=bits,
                HAS_BIAS=has_bias, SPLIT_K=triton.cdiv(k, k_split),
                EVEN=k % k_split == 0 and n % (16 * cfg["ROW_BLOCKS"]) == 0, ROW_BLOCKS=cfg["ROW_BLOCKS"],
                WARPS=warps, PREFETCH_PARTS=prefetch_parts() if use_pdl else 0, USE_PDL=use_pdl)


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


def use_mma_gemv(x: torch.Tensor, weight: IntWeight) -> bool:
    """The tensor-core GEMV for this product: bf16 x on a CUDA GPU of compute capability 8.0 or more (bf16
    mma.sync), a shape it takes, x's row 16-byte aligned (read as int32 pairs, 16 bytes a load), a contiguous
    IntWeight (its strides are compile-time), and TANDEM_INT_GEMV_MMA not 0 (read per call: a CUDA graph keeps
    what its capture chose)."""
    groups = weight.scales.shape[1]
    return (x.is_cuda and x.dtype == torch.bfloat16 and weight.scales.dtype == torch.bfloat16
            and mma_gemv_fits(x.shape[0], weight.shape[1], weight.bits, weight.group_size)
            and x.stride(1) == 1 and x.data_ptr() % 16 == 0
            and weight.words.stride(0) == weight.words.shape[1] and weight.scales.stride(0) == groups
            and weight.mins.stride(0) == groups and os.environ.get("TANDEM_INT_GEMV_MMA", "1") != "0"
            and _has_bf16_mma(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def int_mma_gemv(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None, defer: bool = False,
                 config: dict[str, int] | None = None) -> torch.Tensor | PartialSums:
    """x W^T + b for one bf16 row x [1, K] (use_mma_gemv holds) on the tensor cores; grid and workspace from the
    shape alone (captures in CUDA graphs). With `defer` (and TANDEM_DEFER_REDUCE not 0) a K split hands its
    fp32 partial sums on. config: overrides mma_gemv_config's entries (benchmarks, tests)."""
    n, k = weight.shape
    bits = weight.bits
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    cfg = {**mma_gemv_config(n, k, bits, device_sms(x.device)), **(config or {})}
    pdl = use_pdl(x.device)
    flags = mma_gemv_constexprs(n, k, bits, weight.group_size, cfg, bias is not None, pdl)
    split_k = flags["SPLIT_K"]
    ws = torch.empty(split_k, 1, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    w, scales = weight.words, weight.scales
    _int_mma_gemv_kernel[(triton.cdiv(n, 16 * cfg["ROW_BLOCKS"]), split_k)](
        x, w, scales, weight.mins, bias if bias is not None else scales, out, ws, n, k,
        mma_k_split(k, bits, cfg["SPLIT_K"], cfg["num_warps"]), **flags, num_warps=cfg["num_warps"],
        num_stages=1, launch_pdl=bool(pdl))
    return finish_split(ws, out, bias, split_k, defer)
