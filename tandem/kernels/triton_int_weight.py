"""W4A16 / W8A16 Triton kernels over IntWeight (kernels/int_weight.py): a weight-streaming GEMV for a few decode
rows (dequantized in registers, CUDA cores) and a tile GEMM that dequantizes weight tiles into the activation dtype
for the tensor cores (more rows, prefill)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.int_weight import WORD_BITS, IntWeight
from tandem.kernels.triton_fused import silu_and_mul_triton
from tandem.kernels.triton_int_gemv_mma import int_mma_gemv, tiled_step, use_mma_gemv, word_offsets
from tandem.kernels.triton_int_mma_rows import int_mma_rows, use_mma_rows
from tandem.kernels.triton_launch import device_sms, pdl_wait, prefetch_l2, use_pdl
from tandem.kernels.triton_moe import pair_expert
from tandem.kernels.triton_quant import finish_split, split_k_until

ONE_BITS = 0x3F800000  # the bits of 1.0f


@triton.jit
def _codes_plus_one(words, shifts, one_bits, BITS: tl.constexpr):
    # int32 words [..., 1] and shifts [..., PER_WORD] (where each element's code sits) -> fp32 1 + q / 2**BITS
    # for each code q: the code is placed in the top mantissa bits of 1.0 (one shift and one and-or per element, no
    # int -> float conversion, which issues at a quarter of the FMA rate), exactly. one_bits is 0x3F800000
    # (1.0f), passed at run time so that it sits in a register and the and-or is one LOP3 (ptxas does not
    # fuse an and and an or of two immediates).
    q = (words >> shifts) & ((1 << BITS) - 1)
    return ((q << (23 - BITS)) | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def _code_slots(e, BITS: tl.constexpr):
    # Where element e of a word keeps its code (in units of BITS): 4 bits, nibble e // 2 + 4 (e % 2)
    # (int_weight.NIBBLE_ORDER); 8 bits, byte e.
    if BITS == 4:
        slot = e // 2 + 4 * (e % 2)
    else:
        slot = e
    return slot


@triton.jit
def _word_sums(words, x, s, mn, shifts, ONE_BITS, BITS: tl.constexpr):
    # The GEMV's products, per word: words [1, N, TG, GW] int32, x [M, 1, TG, GW, PER_WORD] fp32, s and mn
    # [1, N, TG, 1] fp32 (a part's scale and min) -> [M, N, TG, GW] sums over each word's elements of x (q s + mn).
    # With f = 1 + q / 2**B (_codes_plus_one) that is 2**B s F - (2**B s - mn) X, F = sum x f and X = sum x: per
    # element one shift, one and-or and one FMA, no scale.
    f = _codes_plus_one(words[:, :, :, :, None], shifts, ONE_BITS, BITS)  # [1, N, TG, GW, PER_WORD]
    fx = tl.sum(x * f, axis=4)  # [M, N, TG, GW]
    xs = tl.sum(x, axis=4)  # [M, 1, TG, GW]
    return (s * (1 << BITS)) * fx - (s * (1 << BITS) - mn) * xs


@triton.jit
def _prefetch_rows(w_ptr, rows, N, stride_wn, word_begin, word_end, PREFETCH_LINES: tl.constexpr,
                   USE_PDL: tl.constexpr, TILED: tl.constexpr):
    # Before the PDL wait (the previous kernel may still run; weights are no kernel's output): the first
    # PREFETCH_LINES 128-byte lines of each weight row's K range go to L2 (TILED: the same words, two 64-byte tile
    # rows a line), so the loads after the wait find them there. rows [R] are the program's channels; words are
    # int32 (32 a line).
    if USE_PDL and PREFETCH_LINES > 0:
        STEP: tl.constexpr = 16 if TILED else 32
        words = word_begin + tl.arange(0, PREFETCH_LINES * 32 // STEP) * STEP
        mask = (rows < N)[:, None] & (words < word_end)[None, :]
        prefetch_l2(w_ptr + word_offsets(rows[:, None], words[None, :], stride_wn, TILED), mask)


@triton.jit
def _int_gemv_kernel(
    x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, K_SPLIT, GROUP: tl.constexpr, ONE_BITS, stride_xm, stride_wn, stride_sn, stride_om,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, MASK_M: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TG: tl.constexpr, GW: tl.constexpr, PREFETCH_LINES: tl.constexpr,
    USE_PDL: tl.constexpr, TILED: tl.constexpr = False,
):
    # Program = BLOCK_N output channels for all M (<= BLOCK_M) rows over K range [pid_k * K_SPLIT, +K_SPLIT).
    # A K step is TG group parts of GW words (GK = GW * PER_WORD elements, one group or a part of one), so a
    # step reads one scale and min per (channel, part). With f = 1 + q / 2**B (_codes_plus_one) a part's sum
    # is sum_k x_k (q_k s + mn) = 2**B s F - (2**B s - mn) X, F = sum_k x_k f_k and X = sum_k x_k: per element
    # one shift, one and-or and one FMA, no scale. Sums stay per word ([M, N, TG, GW]) until after the loop,
    # so no cross-thread reduction runs inside it. EVEN: N and K fill whole tiles, so only x's rows are masked.
    # TILED: the words in tiles of 16 rows x 16 words (int_weight.tile_words; tiled_step).
    PER_WORD: tl.constexpr = 32 // BITS
    GK: tl.constexpr = GW * PER_WORD
    W_STEP: tl.constexpr = tiled_step(TG * GK // PER_WORD, TILED)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)[:, None, None, None]  # [BLOCK_M, 1, 1, 1]
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :, None, None]  # [1, BLOCK_N, 1, 1]
    offs_g = tl.arange(0, TG)[None, None, :, None]  # [1, 1, TG, 1]
    offs_w = tl.arange(0, GW)[None, None, None, :]  # [1, 1, 1, GW]
    offs_e = tl.arange(0, PER_WORD)[None, None, None, None, :]  # [1, 1, 1, 1, PER_WORD]
    n_mask = offs_n < N
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    part = k_begin + offs_g * GK  # first element of each group part in the first step
    w_ptrs = w_ptr + word_offsets(offs_n, part // PER_WORD + offs_w, stride_wn, TILED)  # [1, BLOCK_N, TG, GW]
    x_ptrs = (x_ptr + (offs_m.to(tl.int64) * stride_xm + (part + offs_w * PER_WORD))[:, :, :, :, None]
              + offs_e)  # [BLOCK_M, 1, TG, GW, PER_WORD]
    x_rows = (offs_m < M)[:, :, :, :, None]
    s_rows = s_ptr + offs_n.to(tl.int64) * stride_sn  # [1, BLOCK_N, 1, 1]
    mn_rows = mn_ptr + offs_n.to(tl.int64) * stride_sn
    shifts = _code_slots(offs_e, BITS) * BITS
    acc = tl.zeros([BLOCK_M, BLOCK_N, TG, GW], dtype=tl.float32)
    _prefetch_rows(w_ptr, tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N, stride_wn, k_begin // PER_WORD,
                   k_end // PER_WORD, PREFETCH_LINES, USE_PDL, TILED)
    pdl_wait(USE_PDL)
    for k0 in range(k_begin, k_end, TG * GK):
        start = k0 + offs_g * GK  # [1, 1, TG, 1]
        group = start // GROUP
        if W_STEP == 0:
            w_ptrs = w_ptr + word_offsets(offs_n, start // PER_WORD + offs_w, stride_wn, True)
        if EVEN:
            words = tl.load(w_ptrs)
            s = tl.load(s_rows + group).to(tl.float32)
            mn = tl.load(mn_rows + group).to(tl.float32)
            if MASK_M:
                x = tl.load(x_ptrs, mask=x_rows, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_ptrs).to(tl.float32)
        else:
            g_mask = start < k_end  # whole group parts: K, K_SPLIT and the groups are multiples of GK
            words = tl.load(w_ptrs, mask=n_mask & g_mask, other=0)
            s = tl.load(s_rows + group, mask=n_mask & g_mask, other=0.0).to(tl.float32)
            mn = tl.load(mn_rows + group, mask=n_mask & g_mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptrs, mask=g_mask[:, :, :, :, None] & x_rows, other=0.0).to(tl.float32)
        acc += _word_sums(words, x, s, mn, shifts, ONE_BITS, BITS)
        w_ptrs += W_STEP
        x_ptrs += TG * GK
    y = tl.sum(tl.sum(acc, axis=3), axis=2)  # [BLOCK_M, BLOCK_N]
    rows = tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < M) & (cols < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows.to(tl.int64) * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + (pid_k * M + rows).to(tl.int64) * N + cols, y, mask=mask)


# Two weights per and-or on the GPU (4 bits, the tile GEMM): the codes of a word's elements 2i and 2i + 1 sit in
# bits 4i and 4i + 16 (int_weight.NIBBLE_ORDER), the low bits of its two halves once shifted right by 4i;
# or-ed into the low mantissa bits of MAGIC (128 in bf16, 1024 in fp16: one unit in the last place) the halves
# become MAGIC + q exactly;
# MAGIC is subtracted (exact), and q * s + mn is one packed FMA rounded once to x's dtype. Inputs: the word
# ($8), s ($9) and mn ($10) in the 16-bit type; outputs: the word's 8 weights in element order ($0 .. $7),
# each pair already in one register as the tensor cores read it.
_WORD_ASM = """{
.reg .b32 t0, t1, t2, t3, sp, mp, mask, magic;
mov.b32 mask, 0x000F000F;
mov.b32 magic, MAGIC;
mov.b32 sp, {$9, $9};
mov.b32 mp, {$10, $10};
shr.u32 t1, $8, 4;
shr.u32 t2, $8, 8;
shr.u32 t3, $8, 12;
lop3.b32 t0, $8, mask, magic, 0xea;
lop3.b32 t1, t1, mask, magic, 0xea;
lop3.b32 t2, t2, mask, magic, 0xea;
lop3.b32 t3, t3, mask, magic, 0xea;
sub.rn.TY t0, t0, magic;
sub.rn.TY t1, t1, magic;
sub.rn.TY t2, t2, magic;
sub.rn.TY t3, t3, magic;
fma.rn.TY t0, t0, sp, mp;
fma.rn.TY t1, t1, sp, mp;
fma.rn.TY t2, t2, sp, mp;
fma.rn.TY t3, t3, sp, mp;
mov.b32 {$0, $1}, t0;
mov.b32 {$2, $3}, t1;
mov.b32 {$4, $5}, t2;
mov.b32 {$6, $7}, t3;
}"""
WORD_ASM_BF16 = tl.constexpr(_WORD_ASM.replace("MAGIC", "0x43004300").replace("TY", "bf16x2"))
WORD_ASM_F16 = tl.constexpr(_WORD_ASM.replace("MAGIC", "0x64006400").replace("TY", "f16x2"))
WORD_ASM_CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,h,h")


@triton.jit
def _code_weight(words, e: tl.constexpr, s, mn, out_ty: tl.constexpr):
    # Element e of each 4-bit word, q * s + mn in fp32 rounded once to out_ty.
    q = (words >> (4 * _code_slots(e, 4))) & 0xF
    return (q.to(tl.float32) * s + mn).to(out_ty)


@triton.jit
def _word_weights(words, s, mn, out_ty: tl.constexpr, PACKED: tl.constexpr):
    # int32 words [..., GW] of 4-bit codes, s and mn [..., 1] -> weights [..., GW, 2, 2, 2] in out_ty, element
    # order. PACKED (GPU, 16-bit x; s and mn in x's dtype): the inline assembly above; otherwise fp32 math.
    if PACKED:
        if out_ty == tl.float16:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                asm=WORD_ASM_F16, constraints=WORD_ASM_CONSTRAINTS, args=[words, s, mn],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                asm=WORD_ASM_BF16, constraints=WORD_ASM_CONSTRAINTS, args=[words, s, mn],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        s = s.to(tl.float32)
        mn = mn.to(tl.float32)
        w0 = _code_weight(words, 0, s, mn, out_ty)
        w1 = _code_weight(words, 1, s, mn, out_ty)
        w2 = _code_weight(words, 2, s, mn, out_ty)
        w3 = _code_weight(words, 3, s, mn, out_ty)
        w4 = _code_weight(words, 4, s, mn, out_ty)
        w5 = _code_weight(words, 5, s, mn, out_ty)
        w6 = _code_weight(words, 6, s, mn, out_ty)
        w7 = _code_weight(words, 7, s, mn, out_ty)
    # join adds a last axis: [..., a, b, c] holds element 4a + 2b + c.
    even = tl.join(tl.join(w0, w4), tl.join(w2, w6))
    odd = tl.join(tl.join(w1, w5), tl.join(w3, w7))
    return tl.join(even, odd)


@triton.jit
def _tile_weights(words, s, mn, shifts, ONE_BITS, BITS: tl.constexpr, out_ty: tl.constexpr, PACKED: tl.constexpr,
                  BLOCK_N: tl.constexpr, TG: tl.constexpr, GW: tl.constexpr):
    # A weight tile [BLOCK_N, TG * GW * PER_WORD] in out_ty from its int32 words [BLOCK_N, TG, GW, 1], scales and
    # mins [BLOCK_N, TG, 1] (or [..., GW]: a scale per word), shifts [1, 1, 1, PER_WORD]: q * s + mn rounded once.
    # 4 bits: _word_weights (the packed assembly on the GPU); 8 bits: (f - 1) * 2**B = q exactly, in fp32.
    if BITS == 4:
        w = _word_weights(tl.reshape(words, [BLOCK_N, TG, GW]), s, mn, out_ty, PACKED)
    else:
        f = _codes_plus_one(words, shifts, ONE_BITS, BITS)  # [BLOCK_N, TG, GW, PER_WORD]
        s4 = s.to(tl.float32)[:, :, :, None] * (1 << BITS)
        w = ((f - 1.0) * s4 + mn.to(tl.float32)[:, :, :, None]).to(out_ty)
    return tl.reshape(w, [BLOCK_N, TG * GW * (32 // BITS)])


@triton.jit
def _int_gemm_kernel(
    x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, K_SPLIT, GROUP: tl.constexpr, ONE_BITS, stride_xm, stride_wn, stride_sn, stride_om,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TG: tl.constexpr, GW: tl.constexpr, GROUP_M: tl.constexpr,
    PACKED: tl.constexpr, PREFETCH_LINES: tl.constexpr, USE_PDL: tl.constexpr, WORD_GROUPS: tl.constexpr = False,
    TILED: tl.constexpr = False,
):
    # Program = a BLOCK_M x BLOCK_N output tile over K range [pid_k * K_SPLIT, +K_SPLIT), in K steps of TG
    # group parts of GK elements (as in _int_gemv_kernel). Each step dequantizes its weight tile into x's
    # dtype (q * s + mn, rounded once; 4 bits on the GPU: _WORD_ASM) and multiplies on the tensor cores with
    # fp32 accumulation. Tiles are visited GROUP_M row tiles at a time so that a weight column block is read
    # from HBM once per GROUP_M row tiles (L2 reuse). SWAP_AB (few rows): the weight tile is the MMA's A operand (BLOCK_N fills its 64-row height)
    # and the rows its narrow N. EVEN: N and K fill whole tiles, so only x's rows are masked. PACKED: the 4-bit
    # dequantization by inline assembly (GPU, 16-bit x; TANDEM_INT_PACKED=0: the fp32 math, for comparisons).
    # WORD_GROUPS (groups of fewer than MIN_GEMM_PART elements, GGUF Q6_K's 16): a part spans several groups and
    # each word reads its own scale and min (a narrower part fails Triton's sm_90 layout of the dequantized tile
    # for the MMA). TILED: the words in tiles of 16 rows x 16 words (int_weight.tile_words; tiled_step).
    PER_WORD: tl.constexpr = 32 // BITS
    GK: tl.constexpr = GW * PER_WORD
    BLOCK_K: tl.constexpr = TG * GK
    W_STEP: tl.constexpr = tiled_step(BLOCK_K // PER_WORD, TILED)
    out_ty: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % rows_here
    pid_n = (pid % in_group) // rows_here
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    wn = offs_n[:, None, None]
    wg = tl.arange(0, TG)[None, :, None]
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    w_cols = (wg[:, :, :, None] * GK) // PER_WORD + tl.arange(0, GW)[None, None, :, None]  # [1, TG, GW, 1]
    w_ptrs = w_ptr + word_offsets(wn[:, :, :, None], k_begin // PER_WORD + w_cols, stride_wn, TILED)
    shifts = _code_slots(tl.arange(0, PER_WORD)[None, None, None, :], BITS) * BITS
    x_ptrs = x_rows + (k_begin + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
    s_rows = s_ptr + wn.to(tl.int64) * stride_sn  # [BLOCK_N, 1, 1]
    mn_rows = mn_ptr + wn.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    _prefetch_rows(w_ptr, offs_n, N, stride_wn, k_begin // PER_WORD, k_end // PER_WORD, PREFETCH_LINES, USE_PDL,
                   TILED)
    pdl_wait(USE_PDL)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if W_STEP == 0:
            w_ptrs = w_ptr + word_offsets(wn[:, :, :, None], k0 // PER_WORD + w_cols, stride_wn, True)
        if WORD_GROUPS:  # groups smaller than a part: each word's own scale and min, [1, TG, GW]
            first = k0 + wg * GK + tl.arange(0, GW)[None, None, :] * PER_WORD
        else:
            first = k0 + wg * GK  # [1, TG, 1]
        group = first // GROUP
        if EVEN:
            s = tl.load(s_rows + group)
            mn = tl.load(mn_rows + group)
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            words = tl.load(w_ptrs)  # [BLOCK_N, TG, GW, 1]
        else:
            w_mask = (wn < N) & (first < k_end)
            s = tl.load(s_rows + group, mask=w_mask, other=0.0)
            mn = tl.load(mn_rows + group, mask=w_mask, other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[:, None] & ((k0 + offs_k) < k_end)[None, :], other=0.0)
            words = tl.load(w_ptrs, mask=w_mask[:, :, :, None], other=0)
        w = _tile_weights(words, s, mn, shifts, ONE_BITS, BITS, out_ty, PACKED, BLOCK_N, TG, GW)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        w_ptrs += W_STEP
        x_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    rows = offs_m[:, None]
    cols = offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + cols, mask=n_mask[None, :], other=0.0).to(tl.float32)
        tl.store(out_ptr + rows.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + (pid_k * M + rows).to(tl.int64) * N + cols, acc, mask=mask)


@triton.jit
def _int_dequant_kernel(w_ptr, s_ptr, mn_ptr, out_ptr, N, K, GROUP: tl.constexpr, ONE_BITS, stride_wn, stride_sn,
                        stride_on, BITS: tl.constexpr, BLOCK_N: tl.constexpr, TG: tl.constexpr, GW: tl.constexpr,
                        PACKED: tl.constexpr, TILED: tl.constexpr = False):
    # grid (N tiles, K tiles): W [BLOCK_N, TG * GK] = q * s + mn rounded once to out's dtype, as the tile GEMM
    # dequantizes its weight tiles (_tile_weights, so the dense product uses the GEMM's weights bit for bit).
    PER_WORD: tl.constexpr = 32 // BITS
    GK: tl.constexpr = GW * PER_WORD
    BLOCK_K: tl.constexpr = TG * GK
    out_ty: tl.constexpr = out_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wn = offs_n[:, None, None]
    wg = tl.arange(0, TG)[None, :, None]
    first = tl.program_id(1) * BLOCK_K + wg * GK  # [1, TG, 1]: each part's first element
    n_ok = wn < N
    group = first // GROUP
    s = tl.load(s_ptr + wn.to(tl.int64) * stride_sn + group, mask=n_ok & (first < K), other=0.0)
    mn = tl.load(mn_ptr + wn.to(tl.int64) * stride_sn + group, mask=n_ok & (first < K), other=0.0)
    words = tl.load(w_ptr + word_offsets(wn, first // PER_WORD + tl.arange(0, GW)[None, None, :], stride_wn, TILED),
                    mask=n_ok & (first < K), other=0)  # [BLOCK_N, TG, GW]
    shifts = _code_slots(tl.arange(0, PER_WORD)[None, None, None, :], BITS) * BITS
    w = _tile_weights(words[:, :, :, None], s, mn, shifts, ONE_BITS, BITS, out_ty, PACKED, BLOCK_N, TG, GW)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + k[None, :], w,
             mask=(offs_n[:, None] < N) & (k[None, :] < K))


@triton.jit
def _gather_columns_kernel(x_ptr, perm_ptr, ids_ptr, map_ptr, out_ptr, J, top_k, stride_xm, stride_pe, stride_om,
                           PAIRS: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # out[r, j] = x[r, perm[j]]: perm is a weight (read before the PDL wait), x is the step's activation. PAIRS: row r
    # is a (token, expert) pair, out[r, j] = x[r // top_k, perm[e_r, j]] with e_r its (local) expert, known only
    # after the wait (this step's routing); a pair of another rank's expert (-1) reads expert 0's order, and its row
    # is never read after.
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < J
    if PAIRS:
        pdl_wait(USE_PDL)
        expert = tl.maximum(pair_expert(ids_ptr, map_ptr, row, HAS_MAP), 0)
        src = tl.load(perm_ptr + expert * stride_pe + cols, mask=mask, other=0)
        x_row = row // top_k
    else:
        src = tl.load(perm_ptr + cols, mask=mask, other=0)
        pdl_wait(USE_PDL)
        x_row = row
    v = tl.load(x_ptr + x_row.to(tl.int64) * stride_xm + src, mask=mask)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + cols, v, mask=mask)


def gather_columns_triton(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:  # [M, J]: x[:, perm]
    """x[:, perm] for act order's input columns (x [M, K] with unit column stride, perm int32 or int64 [J] of
    columns below K: J = K on one rank, a row-parallel rank's slice of the permutation over the gathered input
    where the ranks split K) as a kernel in the PDL chain: the integer GEMV after it starts streaming its weights
    while it runs, where index_select (no PDL) would end the chain before and after it."""
    if perm.dim() != 1 or x.dim() != 2 or perm.shape[0] > x.shape[1] or x.stride(1) != 1:
        raise ValueError(f"gather_columns_triton needs x [M, K] with unit column stride and perm [J <= K], got "
                         f"{tuple(x.shape)} / stride {x.stride()} and {tuple(perm.shape)}")
    return gather_rows_columns(x, perm.view(1, -1), x.shape[0])


def gather_rows_columns(x: torch.Tensor, perm: torch.Tensor, rows: int, topk_ids: torch.Tensor | None = None,
                        top_k: int = 1, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, J] from x through perm [orders, J] (unit column stride): x[:, perm[0]] (topk_ids None), or each
    (token, expert) pair's row x[pair // top_k] through its expert's order (topk_ids [pairs] global ids,
    expert_map global -> local). One program per row and column block; callers check the shapes."""
    j = perm.shape[1]
    out = torch.empty(rows, j, dtype=x.dtype, device=x.device)
    if rows == 0 or j == 0:
        return out
    block = min(1024, triton.next_power_of_2(j))
    pdl = use_pdl(x.device)
    ids = topk_ids if topk_ids is not None else perm
    _gather_columns_kernel[(rows, triton.cdiv(j, block))](
        x, perm, ids, expert_map if expert_map is not None else ids, out, j, top_k, x.stride(0), perm.stride(0),
        out.stride(0), PAIRS=topk_ids is not None, HAS_MAP=expert_map is not None, BLOCK=block, USE_PDL=pdl,
        launch_pdl=bool(pdl))
    return out


def dequantize_int_weight_triton(weight: IntWeight, dtype: torch.dtype, out: torch.Tensor | None = None
                                 ) -> torch.Tensor:  # [N, K] in dtype
    """The dense weight an IntWeight holds (q * scale + min rounded once to dtype, the tile GEMM's weights), one
    pass at the copy bandwidth: the large-M path multiplies it with cuBLAS. out: a [N, K] buffer to fill."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.words.device) if out is None else out
    bits, per_word = weight.bits, WORD_BITS // weight.bits
    block_k = 256 if bits == 4 else 128
    gk = part_elements(block_k, weight.group_size, bits)
    packed = (weight.words.is_cuda and bits == 4 and dtype in (torch.bfloat16, torch.float16)
              and weight.scales.dtype == dtype and os.environ.get("TANDEM_INT_PACKED") != "0")
    _int_dequant_kernel[(triton.cdiv(n, 32), triton.cdiv(k, block_k))](
        weight.words, weight.scales, weight.mins, out, n, k, weight.group_size, ONE_BITS, weight.words.stride(0),
        weight.scales.stride(0), out.stride(0), BITS=bits, BLOCK_N=32, TG=block_k // gk, GW=gk // per_word,
        PACKED=packed, TILED=weight.tiled, num_warps=4)
    return out


GEMV_STEP_BYTES = 1024  # bytes of each weight row a GEMV program reads per K step
MIN_GEMM_PART = 32  # elements: the tile GEMM's narrowest group part (below, WORD_GROUPS)
# K steps of each weight row sent to L2 before the PDL wait (TANDEM_INT_PREFETCH_STEPS; 0: none)
PREFETCH_STEPS = int(os.environ.get("TANDEM_INT_PREFETCH_STEPS", "2"))


def part_elements(block_k: int, group_size: int, bits: int) -> int:
    """GK: elements of one group part of a K step: the largest power of two (at least one int32 word) that
    divides group_size, at most block_k. Parts never straddle a group, so a part has one scale and zero."""
    per_word = WORD_BITS // bits
    gk = per_word
    while gk * 2 <= block_k and group_size % (gk * 2) == 0:
        gk *= 2
    return gk


def int_gemv_config(m: int, n: int, k: int, bits: int, group_size: int, sms: int) -> dict[str, int]:
    """The GEMV's tile from the shape alone (graph-safe; a row's result never depends on its batch):
    GEMV_STEP_BYTES of each of BLOCK_N channels per K step, 8 channels at one row (sm_90 ptxas, 4-bit, group
    128: ~4.4 instructions a weight in the loop, against ~5.8 at 4 channels; no spills), fewer channels per
    program where N would leave SMs idle, and K split (into fp32 partial sums added by a second kernel) only
    where even one channel a program leaves fewer programs than SMs."""
    block_k = GEMV_STEP_BYTES * 8 // bits
    while block_k > 64 and block_k >= 2 * k:  # small models: no step mostly past the end of K
        block_k //= 2
    block_n = 8 if m == 1 else 4
    while block_n > 1 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    split_k, steps = 1, triton.cdiv(k, block_k)
    while triton.cdiv(n, block_n) * split_k < sms and split_k < 8 and steps >= 2 * split_k:
        split_k *= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 1}


def int_gemm_config(m: int, n: int, k: int, bits: int, group_size: int, sms: int) -> dict[str, int]:
    """The tile GEMM's tile from the shape alone. Up to 64 rows: 64 x 128 tiles (64 rows: wgmma's least, the
    rows past M masked), 128-wide K steps at 4 bits (64 at 8), K split until ~2 programs per SM (the weight
    stream is the cost). In the sm_90 build (ptxas, no spills) its loop issues ~3.5 instructions a 4-bit
    weight, against ~4.4 for the swap-AB tile (64 channels x 16 rows, `swap_ab_config`), whose weight tile
    reaches the MMA through a shared-memory layout change with ~30 barriers a K step; the 64 rows cost
    tensor-core time that the 16 do not (64 MACs a weight: near the tensor-core peak at the memory roofline),
    so the GPU decides between them (scripts/bench_int_weight.py times both). Above 64 rows, 128 or (past
    128 rows) 256 x 128 tiles of 8 warps: the dequantization of a weight tile is shared by its BLOCK_M rows,
    and at 256 rows the loop issues ~750 cycles of instructions a K step per SM against ~1,000 of tensor-core
    work."""
    if m <= 64:
        block_k = 128 if bits == 4 else 64
        split_k = split_k_until(n, 128, triton.cdiv(k, block_k), 2 * sms, max_split=8)
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": block_k, "SPLIT_K": split_k, "SWAP_AB": False,
                "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    block_m = 128 if m <= 128 else 256
    return {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "SWAP_AB": False, "GROUP_M": 8,
            "num_warps": 8, "num_stages": 3}


def swap_ab_config(n: int, k: int, bits: int, sms: int) -> dict[str, int]:
    """The swap-AB tile for up to 16 rows (64 weight channels fill the MMA's height, the rows its N): 256-wide K
    steps at 4 bits (128 at 8), K split until ~2 programs per SM. Not the default (see int_gemm_config); pass
    it as int_weight_matmul_triton's config to compare."""
    block_k = 256 if bits == 4 else 128
    split_k = split_k_until(n, 64, triton.cdiv(k, block_k), 2 * sms, max_split=8)
    return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": block_k, "SPLIT_K": split_k, "SWAP_AB": True,
            "GROUP_M": 1, "num_warps": 4, "num_stages": 3}


def int_weight_matmul_triton(
    x: torch.Tensor,  # [M, K] bf16/fp16 (fp32 in the interpreter)
    weight: IntWeight,  # scales and mins in x's dtype
    bias: torch.Tensor | None = None,  # [N]
    gemv: bool | None = None,  # the GEMV (True) or the tile GEMM (False); None: by M (use_int_gemv)
    config: dict[str, int] | None = None,  # overrides the config's entries (benchmarks, tests)
    defer: bool = False,  # split over K: may return PartialSums instead of running the reduce
    gated: bool = False,  # W holds gate rows then up rows: returns silu(gate) * up, [M, N / 2]
) -> torch.Tensor | PartialSums:  # [M, N] in x's dtype
    """x W^T + b with W = q * scale + min dequantized inside the kernel: the GEMV for a few rows (one bf16 row:
    the tensor-core GEMV of triton_int_gemv_mma where it applies; 9 to 32 bf16 rows at 4 bits: the many-row kernel
    of triton_int_mma_rows), the tile GEMM otherwise. No host sync, grid
    and workspace from the shape alone: captures in CUDA graphs. With `defer` (and TANDEM_DEFER_REDUCE not 0) a
    K split hands its fp32 partial sums on for the RMSNorm after it. gated: the tensor-core GEMV writes silu(gate)
    * up itself; the other kernels' output goes through silu_and_mul_triton (never deferred)."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] for this weight, got {tuple(x.shape)}")
    if gated:
        if n % 2:
            raise ValueError(f"a gated product needs an even number of weight rows (gate then up), got {n}")
        x = x if x.stride(1) == 1 else x.contiguous()
        one_row = x.shape[0] == 1 and (use_int_gemv(1) if gemv is None else gemv)
        if one_row and config is None and use_mma_gemv(x, weight):
            return int_mma_gemv(x, weight, bias, gated=True)
        return silu_and_mul_triton(int_weight_matmul_triton(x, weight, bias, gemv, config))  # type: ignore[arg-type]
    bits, group_size = weight.bits, weight.group_size
    per_word = WORD_BITS // bits
    m = x.shape[0]
    if gemv is None and config is None and m >= dequant_min_rows() and x.is_cuda:
        # Many rows: the tensor cores, not the weight stream, set the time; the weight dequantized once at the
        # copy bandwidth then cuBLAS beats dequantizing each tile inside a Triton GEMM (kernels-int-weight.json).
        return torch.nn.functional.linear(x, dequantize_int_weight_triton(weight, x.dtype), bias)
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    if gemv is None and config is None and use_mma_rows(x, weight):  # 9 to 32 rows, 4 bits: the many-row kernel
        return int_mma_rows(x, weight, bias, defer)
    use_gemv = use_int_gemv(m) if gemv is None else gemv
    # One bf16 row (or up to mma_max_rows()): the tensor-core GEMV
    if (use_gemv or (gemv is None and m > 1)) and config is None and use_mma_gemv(x, weight):
        return int_mma_gemv(x, weight, bias, defer)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    sms = device_sms(x.device)
    make = int_gemv_config if use_gemv else int_gemm_config
    cfg = {**make(m, n, k, bits, group_size, sms), **(config or {})}
    block_k = cfg.pop("BLOCK_K")
    gk = part_elements(block_k, group_size, bits)
    word_groups = not use_gemv and gk < min(MIN_GEMM_PART, block_k)
    gk = min(MIN_GEMM_PART, block_k) if word_groups else gk
    split_k = cfg.pop("SPLIT_K")
    k_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    split_k = triton.cdiv(k, k_split)  # whole steps per split can leave fewer splits
    ws = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    pdl = use_pdl(x.device)
    w, scales = weight.words, weight.scales
    args = (x, w, scales, weight.mins, bias if bias is not None else scales, out, ws,
            m, n, k, k_split, group_size, ONE_BITS, x.stride(0), w.stride(0), scales.stride(0), out.stride(0))
    lines = PREFETCH_STEPS * block_k * bits // 8 // 128 if pdl else 0  # 128-byte lines of each row
    common = dict(BITS=bits, HAS_BIAS=bias is not None, SPLIT_K=split_k, TG=block_k // gk, GW=gk // per_word,
                  EVEN=k % block_k == 0 and n % cfg["BLOCK_N"] == 0,
                  PREFETCH_LINES=triton.next_power_of_2(lines) if lines else 0, USE_PDL=pdl, TILED=weight.tiled,
                  launch_pdl=bool(pdl))
    if use_gemv:
        block_m = triton.next_power_of_2(m)
        block_n = cfg.pop("BLOCK_N")
        _int_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
            *args, MASK_M=m != block_m, BLOCK_M=block_m, BLOCK_N=block_n, **common, **cfg)
    else:
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split_k)
        packed = (x.is_cuda and bits == 4 and x.dtype in (torch.bfloat16, torch.float16)
                  and scales.dtype == x.dtype and os.environ.get("TANDEM_INT_PACKED") != "0")
        _int_gemm_kernel[grid](*args, PACKED=packed, WORD_GROUPS=word_groups, **common, **cfg)
    return finish_split(ws, out, bias, split_k, defer)


DEQUANT_MIN_ROWS = 512  # rows from which the weight is dequantized whole and multiplied by cuBLAS


def dequant_min_rows() -> int:
    """DEQUANT_MIN_ROWS, or TANDEM_INT_DEQUANT_MIN_ROWS (read per call; 0 or less: never)."""
    override = os.environ.get("TANDEM_INT_DEQUANT_MIN_ROWS")
    value = int(override) if override is not None else DEQUANT_MIN_ROWS
    return value if value > 0 else 1 << 62


INT_GEMV_MAX_ROWS = 1  # rows up to which the CUDA-core GEMV runs; above, the tile GEMM (tensor cores)


def use_int_gemv(m: int) -> bool:
    """Whether m rows run the GEMV: per weight it spends one FMA per row beside the dequantization, while the
    tensor-core GEMM's cost does not grow with the rows up to 16, so the GEMV takes one row
    (INT_GEMV_MAX_ROWS; TANDEM_INT_GEMV_MAX_ROWS=N overrides, read per call: a CUDA graph keeps what its
    capture chose)."""
    override = os.environ.get("TANDEM_INT_GEMV_MAX_ROWS")
    return m <= (int(override) if override is not None else INT_GEMV_MAX_ROWS)
