"""Fused mixture-of-experts over 4- / 8-bit experts (IntWeight stacks): the grouped GEMMs of triton_moe with each
expert weight tile dequantized in registers (triton_int_weight._tile_weights) before the tensor-core dot.

Both projections run one kernel: gate_up (rows are tokens, gate and up tiles of w13 [E, 2I, H] in one pass,
silu(gate) * up in the epilogue, written to pair rows of [pairs, I]) and down (rows are pairs, w2 [E, H, I], each
row scaled by its routing weight). Rows come sorted by expert and padded to BLOCK_M (moe_align, as triton_moe's
GEMMs read them), except for the fewest tokens (`use_pair_path`: decode at batch 1 to a few), which skip the sort:
each pair reads its expert's codes once: by default on the tensor-core GEMV that dense linears run at one row
(triton_int_gemv_mma._int_mma_pair_kernel, a program per pair and row block), or on the CUDA cores as the dense
GEMV runs one row in fp16 (_moe_int_pair_gemv_kernel; TANDEM_MOE_INT_PAIR=gemv), or (=mma) through the
tensor-core tile kernel with the pair alone in its row block. Grids depend on the token count only: graph-safe.

Act-order experts (GPTQ desc_act, compressed-tensors actorder) keep each expert's columns sorted by group, with the
input column each reads (`perms`: [E, H] for w13, [E, I] for w2): every pair's row is first read through its
expert's permutation (`gather_pair_columns_triton`), and gate_up then takes a row per pair instead of per token.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.int_weight import TILE, WORD_BITS, IntWeight
from tandem.kernels.moe_align import AlignedTokens, align_by_expert
from tandem.kernels.triton_int_gemv_mma import int_mma_pair_gemv, tiled_step, use_mma_pair_gemv, word_offsets
from tandem.kernels.triton_int_weight import (
    GEMV_STEP_BYTES,
    MIN_GEMM_PART,
    ONE_BITS,
    _code_slots,
    _tile_weights,
    _word_sums,
    gather_rows_columns,
    part_elements,
)
from tandem.kernels.triton_launch import pdl_wait, use_pdl
from tandem.kernels.triton_moe import (
    ALIGN_KERNEL_MAX_PAIRS,
    MoETile,
    align_by_expert_triton,
    moe_tile,
    pair_config,
    pair_expert,
    use_pair_path,
)

PAIR_ROWS = 16  # the row block of the pair path: one pair in it (tl.dot's least M)
GEMV_WORDS = 512  # int32 words of codes the pair GEMV's 4 warps load per K step at least: 16-byte loads each


def gather_pair_columns_triton(x: torch.Tensor, perm: torch.Tensor, topk_ids: torch.Tensor, top_k: int,
                               expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """[pairs, J]: each (token, expert) pair's row of x (row pair // top_k; x [rows, K] with unit column stride)
    read through its expert's column permutation (perm [local experts, J], J <= K, int32 or int64; topk_ids [pairs]
    global ids, expert_map: global -> local, -1 elsewhere). Graph-safe: one program per pair and column block."""
    if x.dim() != 2 or x.stride(1) != 1 or perm.dim() != 2 or perm.stride(1) != 1 or perm.shape[1] > x.shape[1]:
        raise ValueError(f"pair gather: x {tuple(x.shape)} (unit column stride), perm {tuple(perm.shape)}")
    return gather_rows_columns(x, perm, topk_ids.shape[0], topk_ids, top_k, expert_map)


def int_moe_tile(num_tokens: int, top_k: int, num_experts: int, bits: int, pair_path: bool) -> MoETile:
    """The shape-only tile (graph-safe): the pair path 16 rows (one used) x 32 channels, so that a decode step's
    few pairs still give a few programs per SM; sorted rows triton_moe's tiles. K steps of 128 codes at 4 bits
    (64 at 8: the same 64 bytes of a row) for decode-sized row blocks, 64 for prefill's. TANDEM_MOE_INT_TILE
    ("bm,bn,bk,warps,stages") overrides it."""
    override = os.environ.get("TANDEM_MOE_INT_TILE")
    if override:
        return MoETile(*(int(v) for v in override.split(",")))
    small_k = 128 if bits == 4 else 64
    if pair_path:
        return MoETile(PAIR_ROWS, 32, small_k, 4, 3)
    base = moe_tile(num_tokens, top_k, num_experts)
    return MoETile(base.block_m, base.block_n, small_k if base.block_m <= 16 else 64, base.num_warps, 3)


@triton.jit
def _int_tile(w_ptrs, s_rows, mn_rows, first, K, n_ok, shifts, ONE_BITS, GROUP: tl.constexpr, BITS: tl.constexpr,
              out_ty: tl.constexpr, PACKED: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
              TG: tl.constexpr, GW: tl.constexpr):
    # One K step's weight tile [BLOCK_N, TG * GW * PER_WORD] in out_ty: w_ptrs [BLOCK_N, TG, GW, 1] at the step's
    # words, s_rows / mn_rows [BLOCK_N, 1, 1] at each channel's groups, first [1, TG, 1] each part's first element
    # (parts never straddle a group, so a part reads one scale and min), n_ok [BLOCK_N, 1, 1]. EVEN: N and K fill
    # whole tiles, no mask.
    group = first // GROUP
    if EVEN:
        s = tl.load(s_rows + group)
        mn = tl.load(mn_rows + group)
        words = tl.load(w_ptrs)
    else:
        mask = n_ok & (first < K)
        s = tl.load(s_rows + group, mask=mask, other=0.0)
        mn = tl.load(mn_rows + group, mask=mask, other=0.0)
        words = tl.load(w_ptrs, mask=mask[:, :, :, None], other=0)
    return _tile_weights(words, s, mn, shifts, ONE_BITS, BITS, out_ty, PACKED, BLOCK_N, TG, GW)


@triton.jit
def _moe_int_gemm_kernel(
    a_ptr, w_ptr, s_ptr, mn_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, map_ptr,
    N, K, num_pairs, top_k, up_offset, num_tokens, ONE_BITS,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    GROUP: tl.constexpr, BITS: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr, HAS_MAP: tl.constexpr, SPLIT_MAJOR: tl.constexpr, PACKED: tl.constexpr,
    EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TG: tl.constexpr, GW: tl.constexpr,
    PRECISION: tl.constexpr, USE_PDL: tl.constexpr, TILED: tl.constexpr = False,
):
    # Program (m, n): row block m (all of one expert) times that expert's channels [n * BLOCK_N, +BLOCK_N), in K
    # steps of TG group parts of GW words. PAIR_BLOCKS: block m is pair m alone (row 0; expert_ids_ptr holds the
    # pairs' global expert ids, mapped through map_ptr with HAS_MAP), else blocks of moe_align's sorted pairs
    # (local expert ids). Another rank's expert (-1): nothing runs, nothing is written. SPLIT_MAJOR (down): pair p
    # = token t, choice j goes to row j * num_tokens + t ([top_k, tokens, N] partial sums). TILED: each expert's
    # words in tiles of 16 rows x 16 words (int_weight.tile_words, triton_int_gemv_mma.tiled_step; the up rows start
    # on a tile).
    PER_WORD: tl.constexpr = 32 // BITS
    GK: tl.constexpr = GW * PER_WORD
    BLOCK_K: tl.constexpr = TG * GK
    W_STEP: tl.constexpr = tiled_step(BLOCK_K // PER_WORD, TILED)
    out_ty: tl.constexpr = a_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_M)
    pdl_wait(USE_PDL)
    if PAIR_BLOCKS:
        expert = pair_expert(expert_ids_ptr, map_ptr, pid_m, HAS_MAP)
        pair = pid_m + 0 * lanes
        valid = lanes == 0
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + lanes)
        valid = pair < num_pairs
    if expert < 0:
        return
    row = (pair // top_k) if GATED else pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    wn = offs_n[:, None, None]  # [BLOCK_N, 1, 1]
    n_ok = wn < N
    wg = tl.arange(0, TG)[None, :, None]  # [1, TG, 1]
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row.to(tl.int64)[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_cols = wg[:, :, :, None] * GK // PER_WORD + tl.arange(0, GW)[None, None, :, None]  # [1, TG, GW, 1]
    w_ptrs = w_ptr + expert * stride_we + word_offsets(wn[:, :, :, None], w_cols, stride_wn, TILED)  # [BN, TG, GW, 1]
    s_rows = s_ptr + expert * stride_se + wn.to(tl.int64) * stride_sn  # [BLOCK_N, 1, 1]
    mn_rows = mn_ptr + expert * stride_se + wn.to(tl.int64) * stride_sn
    up_w = up_offset * stride_wn
    up_s = up_offset * stride_sn
    shifts = _code_slots(tl.arange(0, PER_WORD)[None, None, None, :], BITS) * BITS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        first = k0 + wg * GK
        if W_STEP == 0:
            w_ptrs = w_ptr + expert * stride_we + word_offsets(wn[:, :, :, None], k0 // PER_WORD + w_cols, stride_wn,
                                                               True)
        if EVEN:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
        w = _int_tile(w_ptrs, s_rows, mn_rows, first, K, n_ok, shifts, ONE_BITS, GROUP, BITS, out_ty, PACKED,
                      EVEN, BLOCK_N, TG, GW)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        if GATED:
            u = _int_tile(w_ptrs + up_w, s_rows + up_s, mn_rows + up_s, first, K, n_ok, shifts, ONE_BITS, GROUP,
                          BITS, out_ty, PACKED, EVEN, BLOCK_N, TG, GW)
            acc_up = tl.dot(a, tl.trans(u), acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += W_STEP
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc *= tl.load(topk_w_ptr + pair, mask=valid, other=0.0)[:, None]
    out_row = ((pair % top_k) * num_tokens + pair // top_k) if SPLIT_MAJOR else pair
    out_ptrs = out_ptr + out_row.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _moe_int_pair_gemv_kernel(
    a_ptr, w_ptr, s_ptr, mn_ptr, out_ptr, topk_w_ptr, ids_ptr, map_ptr,
    N, K, top_k, up_offset, num_tokens, ONE_BITS,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    GROUP: tl.constexpr, BITS: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_MAP: tl.constexpr,
    SPLIT_MAJOR: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, TG: tl.constexpr, GW: tl.constexpr,
    USE_PDL: tl.constexpr, TILED: tl.constexpr = False,
):
    # Program (pair, n): the pair's row against BLOCK_N channels of its expert over all of K on the CUDA cores, as
    # the dense GEMV at one row (triton_int_weight._int_gemv_kernel, _word_sums): K steps of TG group parts of GW
    # words, sums kept per word until after the loop. GATED: the row is the pair's token, gate and up channels
    # read together, silu(gate) * up written; else the row is the pair, scaled by its routing weight. Another
    # rank's expert: nothing runs, nothing is written. SPLIT_MAJOR and TILED as in _moe_int_gemm_kernel.
    PER_WORD: tl.constexpr = 32 // BITS
    GK: tl.constexpr = GW * PER_WORD
    W_STEP: tl.constexpr = tiled_step(TG * GK // PER_WORD, TILED)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    pdl_wait(USE_PDL)
    expert = pair_expert(ids_ptr, map_ptr, pair, HAS_MAP)
    if expert < 0:
        return
    row = (pair // top_k) if GATED else pair
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :, None, None]  # [1, BLOCK_N, 1, 1]
    offs_g = tl.arange(0, TG)[None, None, :, None]  # [1, 1, TG, 1]
    offs_w = tl.arange(0, GW)[None, None, None, :]  # [1, 1, 1, GW]
    offs_e = tl.arange(0, PER_WORD)[None, None, None, None, :]  # [1, 1, 1, 1, PER_WORD]
    n_mask = offs_n < N
    part = offs_g * GK
    w_ptrs = w_ptr + expert * stride_we + word_offsets(offs_n, part // PER_WORD + offs_w, stride_wn, TILED)
    x_ptrs = a_ptr + row.to(tl.int64) * stride_am + (part + offs_w * PER_WORD)[:, :, :, :, None] + offs_e
    s_rows = s_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn  # [1, BLOCK_N, 1, 1]
    mn_rows = mn_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
    up_w = up_offset * stride_wn
    up_s = up_offset * stride_sn
    shifts = _code_slots(offs_e, BITS) * BITS
    acc = tl.zeros([1, BLOCK_N, TG, GW], dtype=tl.float32)
    acc_up = tl.zeros([1, BLOCK_N, TG, GW], dtype=tl.float32)
    for k0 in range(0, K, TG * GK):
        start = k0 + part  # [1, 1, TG, 1]
        group = start // GROUP
        if W_STEP == 0:
            w_ptrs = w_ptr + expert * stride_we + word_offsets(offs_n, start // PER_WORD + offs_w, stride_wn, True)
        if EVEN:
            x = tl.load(x_ptrs).to(tl.float32)
            words = tl.load(w_ptrs)
            s = tl.load(s_rows + group).to(tl.float32)
            mn = tl.load(mn_rows + group).to(tl.float32)
        else:
            mask = n_mask & (start < K)  # whole group parts: K and the groups are multiples of GK
            x = tl.load(x_ptrs, mask=(start < K)[:, :, :, :, None], other=0.0).to(tl.float32)
            words = tl.load(w_ptrs, mask=mask, other=0)
            s = tl.load(s_rows + group, mask=mask, other=0.0).to(tl.float32)
            mn = tl.load(mn_rows + group, mask=mask, other=0.0).to(tl.float32)
        acc += _word_sums(words, x, s, mn, shifts, ONE_BITS, BITS)
        if GATED:
            if EVEN:
                words = tl.load(w_ptrs + up_w)
                s = tl.load(s_rows + up_s + group).to(tl.float32)
                mn = tl.load(mn_rows + up_s + group).to(tl.float32)
            else:
                words = tl.load(w_ptrs + up_w, mask=mask, other=0)
                s = tl.load(s_rows + up_s + group, mask=mask, other=0.0).to(tl.float32)
                mn = tl.load(mn_rows + up_s + group, mask=mask, other=0.0).to(tl.float32)
            acc_up += _word_sums(words, x, s, mn, shifts, ONE_BITS, BITS)
        w_ptrs += W_STEP
        x_ptrs += TG * GK
    y = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=0)  # [BLOCK_N]
    if GATED:
        up = tl.sum(tl.sum(tl.sum(acc_up, axis=3), axis=2), axis=0)
        y = y / (1.0 + tl.exp(-y)) * up
    if MUL_WEIGHT:
        y *= tl.load(topk_w_ptr + pair)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_row = ((pair % top_k) * num_tokens + pair // top_k) if SPLIT_MAJOR else pair
    tl.store(out_ptr + out_row.to(tl.int64) * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=cols < N)


def pair_gemv_tile(n: int, k: int, bits: int, group_size: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the pair GEMV, from the shape alone: GEMV_STEP_BYTES of each of 8 channels per K step
    (the dense GEMV's one-row tile), halved while that is more than K or does not divide it (no step past the end
    where a smaller one fits), and more channels while a step holds fewer than GEMV_WORDS words (Qwen3-30B-A3B's
    down projection, K 768: 256-wide steps, 16 channels); TANDEM_MOE_INT_GEMV="BLOCK_N,BLOCK_K" overrides it."""
    override = os.environ.get("TANDEM_MOE_INT_GEMV")
    if override:
        block_n, block_k = (int(v) for v in override.split(","))
        return block_n, block_k
    block_k = GEMV_STEP_BYTES * 8 // bits
    per_word = WORD_BITS // bits
    while block_k > max(per_word, 64) and (block_k > k or k % block_k):
        block_k //= 2
    block_n = 8
    while block_n < 64 and block_n * (block_k // per_word) < GEMV_WORDS:
        block_n *= 2
    return block_n, block_k


def moe_int_pair_gemv(
    a: torch.Tensor, w: IntWeight, out: torch.Tensor, topk_ids: torch.Tensor, top_k: int, gated: bool,
    expert_map: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None, split_major: bool = False,
) -> None:
    """out[pair] = (silu(gate) * up of) the pair's row of a against its expert in w, on the CUDA cores; one program
    per pair and N tile (see _moe_int_pair_gemv_kernel)."""
    n, k = out.shape[1], a.shape[1]
    bits, group = w.bits, w.group_size
    per_word = WORD_BITS // bits
    block_n, block_k = pair_gemv_tile(n, k, bits, group)
    gk = part_elements(block_k, group, bits)
    assert a.stride(1) == 1 and w.words.stride(2) == 1 and out.stride(1) == 1
    if w.scales.stride() != w.mins.stride():
        raise ValueError("integer experts need scales and mins of one layout")
    pdl = use_pdl(a.device)
    _moe_int_pair_gemv_kernel[(out.shape[0], triton.cdiv(n, block_n))](
        a, w.words, w.scales, w.mins, out, topk_weights if topk_weights is not None else out, topk_ids,
        expert_map if expert_map is not None else topk_ids,
        n, k, top_k, n, out.shape[0] // top_k, ONE_BITS,
        a.stride(0), w.words.stride(0), w.words.stride(1), w.scales.stride(0), w.scales.stride(1), out.stride(0),
        GROUP=group, BITS=bits, GATED=gated, MUL_WEIGHT=topk_weights is not None, HAS_MAP=expert_map is not None,
        SPLIT_MAJOR=split_major, EVEN=k % block_k == 0 and n % block_n == 0, BLOCK_N=block_n,
        TG=block_k // gk, GW=gk // per_word, USE_PDL=pdl, TILED=w.tiled, num_warps=4, num_stages=1,
        launch_pdl=bool(pdl),
    )


PAIR_KERNELS = ("gemv", "mma", "mma_gemv")


def pair_kernel() -> str:
    """The pair path's kernel: "mma_gemv" (the default: the tensor-core GEMV of dense linears at one row,
    triton_int_gemv_mma.int_mma_pair_gemv, for bf16 activations; the CUDA-core GEMV where it does not apply),
    "gemv" (CUDA cores, as dense linears run one row in fp16) or "mma" (the tensor-core tile kernel, one pair a
    16-row block); TANDEM_MOE_INT_PAIR chooses (read per call: a graph keeps its capture's). On an H200 at
    Qwen3-30B-A3B's expert shape, 4 bits, one MoE layer: 18.6 us against 27.2 (gemv) and 32.3 (mma) at one token,
    37.5 against 83.4 and 80.7 at four (scripts/bench_moe.py --int 4 --sweep)."""
    choice = os.environ.get("TANDEM_MOE_INT_PAIR", "mma_gemv")
    if choice not in PAIR_KERNELS:
        raise ValueError(f"TANDEM_MOE_INT_PAIR must be one of {', '.join(PAIR_KERNELS)}, got {choice!r}")
    return choice


def moe_int_gemm(
    a: torch.Tensor,  # [rows, K]: tokens (gated) or pairs
    w: IntWeight,  # a stack: [E, N or 2N, K]
    out: torch.Tensor,  # [pairs, N] (split_major: [top_k * tokens, N])
    tile: MoETile,
    top_k: int,
    gated: bool,
    aligned: AlignedTokens | None = None,  # None: the pair path, one pair a row block
    topk_ids: torch.Tensor | None = None,  # the pair path: [pairs] int32 global expert ids
    expert_map: torch.Tensor | None = None,  # the pair path: global -> local id, -1 elsewhere
    topk_weights: torch.Tensor | None = None,  # [pairs] fp32: scales each output row
    split_major: bool = False,
) -> None:
    n, k = out.shape[1], a.shape[1]
    bits, group = w.bits, w.group_size
    per_word = WORD_BITS // bits
    gk = part_elements(tile.block_k, group, bits)
    if gk < min(MIN_GEMM_PART, tile.block_k) or w.scales.stride() != w.mins.stride():
        raise ValueError(f"integer experts need groups of at least {MIN_GEMM_PART} elements (got {group}) and "
                         "scales and mins of one layout")
    assert a.stride(1) == 1 and w.words.stride(2) == 1 and out.stride(1) == 1
    pair_blocks = aligned is None
    ids = topk_ids if pair_blocks else aligned.expert_ids
    num_blocks = ids.shape[0]
    packed = (a.is_cuda and bits == 4 and a.dtype in (torch.bfloat16, torch.float16)
              and w.scales.dtype == a.dtype and os.environ.get("TANDEM_INT_PACKED") != "0")
    pdl = use_pdl(a.device)
    num_pairs = out.shape[0]
    _moe_int_gemm_kernel[(num_blocks, triton.cdiv(n, tile.block_n))](
        a, w.words, w.scales, w.mins, out, topk_weights if topk_weights is not None else out,
        ids if pair_blocks else aligned.sorted_pair_ids, ids, ids if pair_blocks else aligned.num_padded,
        expert_map if expert_map is not None else ids,
        n, k, num_pairs, top_k, n, num_pairs // top_k, ONE_BITS,
        a.stride(0), w.words.stride(0), w.words.stride(1), w.scales.stride(0), w.scales.stride(1), out.stride(0),
        GROUP=group, BITS=bits, GATED=gated, MUL_WEIGHT=topk_weights is not None, PAIR_BLOCKS=pair_blocks,
        HAS_MAP=pair_blocks and expert_map is not None, SPLIT_MAJOR=split_major, PACKED=packed,
        EVEN=k % tile.block_k == 0 and n % tile.block_n == 0,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, TG=tile.block_k // gk, GW=gk // per_word,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", USE_PDL=pdl, TILED=w.tiled,
        num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=bool(pdl),
    )


def fused_moe_int_triton(
    x: torch.Tensor,  # [num_tokens, hidden] bf16 / fp16 (fp32 in the interpreter)
    w13: IntWeight,  # [num_local_experts, 2 * inter, hidden]; scales in x's dtype
    w2: IntWeight,  # [num_local_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32, global ids
    expert_map: torch.Tensor | None = None,
    tile: MoETile | None = None,  # overrides int_moe_tile (tests)
    pair_path: bool | None = None,  # None: by token count (use_pair_path)
    into_norm: bool = False,  # the output goes only into a residual add + RMSNorm: PartialSums are fine
    perms: tuple[torch.Tensor, torch.Tensor] | None = None,  # act order: ([E, hidden], [E, inter]) input columns
    # act order over ranks that split inter: this rank's [pairs, inter] gathered to the whole [pairs, ranks * inter]
    gather_inter: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | PartialSums:  # [num_tokens, hidden]
    """triton_moe.fused_moe_triton for integer experts: the same paths and outputs (the pair path's down rows
    handed to the norm as PartialSums under TANDEM_MOE_PAIR's "norm"; its "sum" runs as "pairs" here, and its
    BLOCK_N is the bf16 kernels' only), each weight tile dequantized in registers. A tile given runs the
    tensor-core kernel on either path. perms (act order): each pair's rows read through its expert's columns
    (gather_pair_columns_triton) before gate_up and before down (down's from the ranks' activations gathered,
    gather_inter, where ranks split the intermediate size). No host sync: captures in CUDA graphs."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.words.shape[0], *w13.shape
    inter = two_inter // 2
    if w2.shape != (hidden, inter) or x.shape[1] != hidden:
        raise ValueError(f"integer experts: w13 {(two_inter, hidden)}, w2 {w2.shape} and x {tuple(x.shape)} "
                         "disagree")
    if w13.tiled and inter % TILE:
        raise ValueError(f"integer experts: w13's up rows start at {inter}, inside a tile of its words (tiled by its "
                         f"gate and up halves: inter a multiple of {TILE})")
    x = x if x.stride(1) == 1 else x.contiguous()
    num_global = expert_map.shape[0] if expert_map is not None else num_experts
    if pair_path is None:
        pair_path = use_pair_path(num_tokens, top_k, num_global)
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1).float().contiguous()
    ids = topk_ids.reshape(-1)  # [pairs]: the pair path's and the act-order gathers' expert ids
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    x13, k13 = x, top_k  # gate_up's rows, and pairs a row: a token's (its pairs share it), or with act order a pair's
    if perms is not None:
        x13, k13 = gather_pair_columns_triton(x, perms[0], ids, top_k, expert_map), 1

    def down_rows(act: torch.Tensor) -> torch.Tensor:  # down's rows (a pair's): act, or read through w2's order
        if perms is None:
            return act
        whole = act if gather_inter is None else gather_inter(act)
        return gather_pair_columns_triton(whole, perms[1], ids, 1, expert_map)

    # Pairs of another rank's experts are never written: zeros make them add nothing.
    alloc = torch.zeros if expert_map is not None else torch.empty
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [pairs, inter]
    if pair_path:
        partials = into_norm and pair_config()[1] == "norm"
        rows = alloc(num_pairs, hidden, dtype=torch.float32, device=x.device)
        choice = pair_kernel() if tile is None else "mma"
        if choice == "mma_gemv" and use_mma_pair_gemv(x13, w13) and use_mma_pair_gemv(act, w2):
            int_mma_pair_gemv(x13, w13, act, ids, k13, gated=True, expert_map=expert_map)
            int_mma_pair_gemv(down_rows(act), w2, rows, ids, top_k, gated=False, expert_map=expert_map,
                              topk_weights=weights, split_major=partials)
        elif choice != "mma":
            moe_int_pair_gemv(x13, w13, act, ids, k13, gated=True, expert_map=expert_map)
            moe_int_pair_gemv(down_rows(act), w2, rows, ids, top_k, gated=False, expert_map=expert_map,
                              topk_weights=weights, split_major=partials)
        else:
            t13 = tile or int_moe_tile(num_tokens, top_k, num_global, w13.bits, True)
            t2 = tile or int_moe_tile(num_tokens, top_k, num_global, w2.bits, True)
            moe_int_gemm(x13, w13, act, t13, k13, gated=True, topk_ids=ids, expert_map=expert_map)
            moe_int_gemm(down_rows(act), w2, rows, t2, top_k, gated=False, topk_ids=ids, expert_map=expert_map,
                         topk_weights=weights, split_major=partials)
        if partials:  # [top_k, tokens, hidden]: the norm after the block adds them in top_k order
            return PartialSums(rows.view(top_k, num_tokens, hidden), None, None, x.dtype)
        return rows.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
    t13 = tile or int_moe_tile(num_tokens, top_k, num_experts, w13.bits, False)
    t2 = tile or int_moe_tile(num_tokens, top_k, num_experts, w2.bits, False)
    if t13.block_m != t2.block_m:
        raise ValueError("both projections of integer experts need one row block")
    if num_pairs <= ALIGN_KERNEL_MAX_PAIRS:
        aligned = align_by_expert_triton(topk_ids, num_experts, t13.block_m, expert_map)
    else:
        aligned = align_by_expert(topk_ids, num_experts, t13.block_m, expert_map)
    moe_int_gemm(x13, w13, act, t13, k13, gated=True, aligned=aligned)
    down = alloc(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [pairs, hidden]
    moe_int_gemm(down_rows(act), w2, down, t2, top_k, gated=False, aligned=aligned, topk_weights=weights)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
