"""Fused mixture-of-experts on the GPU: two grouped GEMMs over every expert a step's tokens route to.

The token-expert pairs come sorted by expert and padded per expert to BLOCK_M (`moe_align.align_by_expert`, device
ops only); program (m, n) multiplies block m's rows, all of one expert, by that expert's weight tile n:
- gate_up: rows are tokens (pair // top_k), w13 [E, 2I, H]; gate and up tiles in one pass, silu(gate) * up in the
  epilogue, written to pair rows of an [pairs, I] buffer;
- down: rows are those pairs, w2 [E, H, I]; the routing weight scales each row in the epilogue, written to pair rows
  of [pairs, H], then summed over top_k.
Grids depend on the token count only (a bound on the blocks any routing needs; programs past the used blocks
return at once), so a decode step captures into a CUDA graph. FP8 weights (per output channel) are widened to the
activation dtype tile by tile and their scales applied to the accumulator. Small batches (decode: a few pairs per
expert) take BLOCK_M 16 and long K tiles, large ones (prefill) BLOCK_M 64 and wider N tiles.

The fewest tokens (decode at batch 1 to a few: `use_pair_path`) skip the sort altogether: one weight-streaming GEMV
program per (token-expert pair, N tile) reads that pair's expert rows once (gate_up), then one per (pair, N tile)
runs its weighted down projection into fp32 rows, which the residual add + RMSNorm after the block adds up (one
rank) or one sum over top_k does (`pair_config` names the other modes); pairs of one token choose distinct
experts, so at batch 1 every touched weight is read exactly once, with no align kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.moe_align import AlignedTokens, align_by_expert, max_aligned_blocks
from tandem.kernels.triton_gemv import _fma_tile
from tandem.kernels.triton_launch import pdl_wait, use_pdl


@dataclass(frozen=True, slots=True)
class MoETile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Pairs per expert (num_tokens * top_k / experts) up to this run the small-batch tile.
SMALL_BATCH_PAIRS_PER_EXPERT = 16


def moe_tile(num_tokens: int, top_k: int, num_experts: int) -> MoETile:
    """Shape-only tile choice (graph-safe): decode-sized batches stream the weights with short row blocks."""
    override = os.environ.get("TANDEM_MOE_TILE")  # "bm,bn,bk,warps,stages" for tuning
    if override:
        return MoETile(*(int(v) for v in override.split(",")))
    if num_tokens * top_k <= SMALL_BATCH_PAIRS_PER_EXPERT * num_experts:
        return MoETile(16, 64, 128, 4, 4)
    return MoETile(64, 128, 64, 8, 3)


@triton.jit
def pair_expert(ids_ptr, map_ptr, pair, HAS_MAP: tl.constexpr):
    # A (token, expert) pair's expert: its global id, through the map to this rank's local one (HAS_MAP; -1: another
    # rank's), as int64 for the stack offsets
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert).to(tl.int64)
    return expert


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, NUM_BINS: tl.constexpr, PICKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One token: softmax over its experts in fp32, the TOP_K largest in descending order (first index on ties),
    # optionally divided by their sum (PICKS: TOP_K to a power of two). Each pick is one max over a packed int64
    # key, the probability's bits above the bin reversed (so the lower bin wins a tie), where a max and then a min
    # took two cross-warp reductions; the picks stay in registers and are stored once.
    row = tl.program_id(0)
    bins = tl.arange(0, NUM_BINS)
    picks = tl.arange(0, PICKS)
    pdl_wait(USE_PDL)
    x = tl.load(logits_ptr + row * stride_l + bins, mask=bins < num_experts, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = e / tl.sum(e, axis=0)
    # A row of NaN or inf logits (a graph's padding row, whose hidden state is never read) still picks TOP_K
    # distinct valid experts: NaN probabilities count as 0. p >= 0, so its fp32 bits order as integers; a valid
    # bin's key is at least 1 << 32, the power-of-two bins past the last expert and the picked ones 0.
    p = tl.where(p == p, p, 0.0)
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(bins < num_experts, ((bits + 1) << 32) | (NUM_BINS - 1 - bins), 0)
    ids = tl.zeros([PICKS], dtype=tl.int32)
    vals = tl.zeros([PICKS], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        idx = NUM_BINS - 1 - (best & (NUM_BINS - 1)).to(tl.int32)
        val = ((best >> 32) - 1).to(tl.int32).to(tl.float32, bitcast=True)
        ids = tl.where(picks == k, idx, ids)
        vals = tl.where(picks == k, val, vals)
        key = tl.where(bins == idx, 0, key)
    if RENORMALIZE:
        vals = vals / tl.sum(vals, axis=0)
    tl.store(ids_ptr + row * TOP_K + picks, ids, mask=picks < TOP_K)
    tl.store(weights_ptr + row * TOP_K + picks, vals, mask=picks < TOP_K)


def route_topk_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align.route_topk in one launch: (weights [n, top_k] fp32, ids [n, top_k] int32)."""
    n, num_experts = router_logits.shape
    weights = torch.empty(n, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int32, device=router_logits.device)
    if n == 0:
        return weights, ids
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    pdl = use_pdl(router_logits.device)
    bins = triton.next_power_of_2(num_experts)
    _route_kernel[(n,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, NUM_BINS=bins, PICKS=triton.next_power_of_2(top_k), USE_PDL=pdl,
        num_warps=1 if bins <= 256 else 4, launch_pdl=bool(pdl),  # one warp: its reductions are shuffles alone
    )
    return weights, ids


# Up to this many token-expert pairs the sort/align is one Triton program (_align_kernel) instead of ~20 device ops.
ALIGN_KERNEL_MAX_PAIRS = 4096
ALIGN_CHUNK = 64


@triton.jit
def _count_experts_kernel(ids_ptr, counter_ptr, num_pairs, num_experts, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    # One program: which experts any pair routes to, then counter += how many (benchmark statistics).
    pdl_wait(USE_PDL)
    bins = tl.arange(0, NUM_BINS)
    seen = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        seen = tl.maximum(seen, tl.max((ids[:, None] == bins[None, :]).to(tl.int32), axis=0))
    seen = tl.where(bins < num_experts, seen, 0)
    tl.store(counter_ptr, tl.load(counter_ptr) + tl.sum(seen, axis=0).to(tl.int64))


def count_routed_experts_triton(topk_ids: torch.Tensor, num_experts: int, counter: torch.Tensor) -> None:
    """counter (an int64 scalar on the device) += the distinct experts of topk_ids, in one launch; one program loops
    over every pair, so ops.count_routed_experts sends only decode-sized steps here."""
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    pdl = use_pdl(ids.device)
    _count_experts_kernel[(1,)](
        ids, counter, ids.numel(), num_experts, NUM_BINS=triton.next_power_of_2(num_experts), CHUNK=ALIGN_CHUNK,
        USE_PDL=pdl, num_warps=4, launch_pdl=bool(pdl),
    )


@triton.jit
def _align_kernel(
    ids_ptr, map_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, num_experts, max_blocks,
    HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program: counts per local expert (pairs of another rank's experts go to no bin), each expert's run
    # padded to BLOCK_M, the block -> expert table, then every pair written at its expert's start plus its rank
    # among that expert's earlier pairs (stable), all as [CHUNK, NUM_BINS] one-hot sums: no atomics, no gather.
    bins = tl.arange(0, NUM_BINS)
    offs = tl.arange(0, CHUNK)
    pdl_wait(USE_PDL)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        pair = c0 + offs
        expert = _local_expert(ids_ptr, map_ptr, pair, num_pairs, num_experts, HAS_MAP)
        counts += tl.sum((expert[:, None] == bins[None, :]).to(tl.int32), axis=0)
    # Bin num_experts collects padding lanes and other ranks' pairs: it gets no space.
    padded = tl.where(bins < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded)
    tl.store(num_padded_ptr, total)
    for b0 in range(0, max_blocks, CHUNK):
        block = b0 + offs
        first = block * BLOCK_M
        owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)  # runs that end before it
        tl.store(expert_ids_ptr + block, tl.where(first < total, owner, -1), mask=block < max_blocks)
        for j in range(BLOCK_M):
            tl.store(sorted_ptr + first + j, num_pairs + 0 * block, mask=block < max_blocks)
    tl.debug_barrier()  # the padding is written before any pair lands on top of it
    running = tl.zeros([NUM_BINS], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        pair = c0 + offs
        expert = _local_expert(ids_ptr, map_ptr, pair, num_pairs, num_experts, HAS_MAP)
        onehot = (expert[:, None] == bins[None, :]).to(tl.int32)
        earlier = tl.cumsum(onehot, 0) - onehot  # this chunk's earlier pairs of the same expert
        dest = tl.sum(onehot * (earlier + (starts + running)[None, :]), axis=1)
        tl.store(sorted_ptr + dest, pair, mask=expert < num_experts)
        running += tl.sum(onehot, axis=0)


@triton.jit
def _local_expert(ids_ptr, map_ptr, pair, num_pairs, num_experts, HAS_MAP: tl.constexpr):
    # The pair's local expert, or num_experts (no bin that counts) for padding lanes and other ranks' experts.
    valid = pair < num_pairs
    expert = tl.load(ids_ptr + pair, mask=valid, other=0)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert, mask=valid, other=-1)
        expert = tl.where(expert < 0, num_experts, expert)
    return tl.where(valid, expert, num_experts)


def align_by_expert_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None,
) -> AlignedTokens:
    """align_by_expert's used part in one Triton program (num pairs <= ALIGN_KERNEL_MAX_PAIRS)."""
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    num_pairs = ids.shape[0]
    max_blocks = max_aligned_blocks(num_pairs, num_experts + 1, block_m)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    num_bins = triton.next_power_of_2(num_experts + 1)
    pdl = use_pdl(ids.device)
    _align_kernel[(1,)](
        ids, expert_map if expert_map is not None else ids, sorted_ids, expert_ids, num_padded,
        num_pairs, num_experts, max_blocks,
        HAS_MAP=expert_map is not None, BLOCK_M=block_m, NUM_BINS=num_bins, CHUNK=ALIGN_CHUNK, USE_PDL=pdl,
        num_warps=8 if num_bins >= 256 else 4, launch_pdl=bool(pdl),
    )
    return AlignedTokens(sorted_ids, expert_ids, num_padded, block_m)


def use_pair_path(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Pairs few enough next to the experts that two of them rarely share one (shape-only: graph-safe)."""
    limit = os.environ.get("TANDEM_MOE_PAIR_MAX_PAIRS")
    max_pairs = int(limit) if limit is not None else max(top_k, num_experts // 4)
    return num_tokens * top_k <= max_pairs


@triton.jit
def _moe_pair_gemv_kernel(
    a_ptr, w_ptr, out_ptr, scale_ptr, topk_w_ptr, ids_ptr, map_ptr,
    N, K, top_k, up_offset, stride_am, stride_we, stride_wn, stride_om, stride_se, num_tokens,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_MAP: tl.constexpr,
    SPLIT_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program (pair, n): BLOCK_N output channels of the pair's expert over all of K, fp32 partial sums per VEC
    # group reduced once after the loop. GATED: rows are tokens (pair // top_k), gate and up rows read together
    # and silu(gate) * up written; else rows are pairs, scaled by the pair's routing weight. A pair whose expert
    # lives on another rank is skipped (its down row written as zeros). SPLIT_MAJOR (down only): pair p = token t,
    # choice j is written at row j * num_tokens + t, so out is [top_k, tokens, N]: split-K-shaped partial sums.
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    pdl_wait(USE_PDL)
    expert = pair_expert(ids_ptr, map_ptr, pair, HAS_MAP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    out_row = ((pair % top_k) * num_tokens + pair // top_k) if SPLIT_MAJOR else pair
    out_ptrs = out_ptr + out_row.to(tl.int64) * stride_om + offs_n
    if expert < 0:
        if not GATED:
            tl.store(out_ptrs, tl.zeros((BLOCK_N,), dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=n_mask)
        return
    row = (pair // top_k) if GATED else pair
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = a_ptr + row.to(tl.int64) * stride_am + offs_k[None, None, :]  # [1, 1, BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :]
    acc = tl.zeros([1, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc_up = tl.zeros([1, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (offs_k < K - k0)[None, None, :]
        x = tl.load(x_ptrs, mask=k_mask, other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[None, :, None] & k_mask, other=0.0)
        acc = _fma_tile(acc, x, w, 1, BLOCK_N, BLOCK_K, VEC)
        if GATED:
            u = tl.load(w_ptrs + up_offset * stride_wn, mask=n_mask[None, :, None] & k_mask, other=0.0)
            acc_up = _fma_tile(acc_up, x, u, 1, BLOCK_N, BLOCK_K, VEC)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(tl.sum(acc, axis=2), axis=0)  # [BLOCK_N]
    if HAS_SCALE:
        y *= tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_mask, other=0.0)
    if GATED:
        up = tl.sum(tl.sum(acc_up, axis=2), axis=0)
        if HAS_SCALE:
            up *= tl.load(scale_ptr + expert * stride_se + up_offset + offs_n, mask=n_mask, other=0.0)
        y = y / (1.0 + tl.exp(-y)) * up
    if MUL_WEIGHT:
        y *= tl.load(topk_w_ptr + pair)
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _moe_pair_down_sum_kernel(
    a_ptr, w_ptr, out_ptr, scale_ptr, topk_w_ptr, ids_ptr, map_ptr,
    N, K, stride_am, stride_we, stride_wn, stride_om, stride_se,
    TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_MAP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (token, n): the down projection of each of the token's TOP_K pairs, scaled by its routing weight
    # and summed in registers (in k order), written once: no [pairs, hidden] buffer and no reduction kernel.
    # Another rank's expert: its loads are masked off (no bytes read) and it adds nothing.
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    pdl_wait(USE_PDL)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        pair = token * TOP_K + j
        expert = pair_expert(ids_ptr, map_ptr, pair, HAS_MAP)
        here = expert >= 0
        expert = tl.maximum(expert, 0)
        x_ptrs = a_ptr + pair.to(tl.int64) * stride_am + offs_k[None, None, :]
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :]
        acc = tl.zeros([1, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (offs_k < K - k0)[None, None, :] & here
            x = tl.load(x_ptrs, mask=k_mask, other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :, None] & k_mask, other=0.0)
            acc = _fma_tile(acc, x, w, 1, BLOCK_N, BLOCK_K, VEC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y = tl.sum(tl.sum(acc, axis=2), axis=0)
        if HAS_SCALE:
            y *= tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_mask & here, other=0.0)
        total += tl.where(here, y * tl.load(topk_w_ptr + pair), 0.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


PAIR_BLOCK_N, PAIR_BLOCK_K = 32, 256
# Per-pair down GEMVs, then a sum over top_k: on an H200 (Qwen3-30B-A3B layer, scripts/bench_moe.py --sweep) 29.0 us
# at 1 token against 40.5 us for the in-register sum, 44.1 against 52.6 at 2, even at 4 (twice the programs fill the
# SMs: at 1 token the sum has 64 programs each looping over 8 experts). Handing those per-pair rows to the norm after
# the block ("norm", one rank) drops the sum and cast kernels: moe-bs1 on an H200 (2026-11-28) 358.8 tok/s against
# 328.6 with "pairs".
PairDown = Literal["sum", "pairs", "norm"]
PAIR_DOWN: PairDown = "norm"


def pair_config() -> tuple[int, PairDown]:
    """The pair path's N tile, and its down projection: "sum" (one program per token and N tile sums the token's
    pairs in registers), "pairs" (one GEMV program per pair and N tile into fp32 rows, then a sum over top_k) or
    "norm" (those rows handed, unsummed, to the residual add + RMSNorm after the MoE block, as PartialSums, where
    the caller allows it; else "pairs"). The default is (PAIR_BLOCK_N, PAIR_DOWN);
    TANDEM_MOE_PAIR="BLOCK_N[,sum|pairs|norm]" overrides it (scripts/bench_moe.py --sweep)."""
    spec = os.environ.get("TANDEM_MOE_PAIR")
    if not spec:
        return PAIR_BLOCK_N, PAIR_DOWN
    block_n, _, down = spec.partition(",")
    if not block_n.isdigit() or int(block_n) not in (8, 16, 32, 64, 128) or down not in ("", "sum", "pairs", "norm"):
        raise ValueError(f"TANDEM_MOE_PAIR must be BLOCK_N (8..128, a power of 2)[,sum|pairs|norm], got {spec!r}")
    return int(block_n), (down or PAIR_DOWN)  # type: ignore[return-value]


def moe_pair_down_sum(
    act: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    top_k: int, expert_map: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    block_n: int = PAIR_BLOCK_N,
) -> None:
    """out[token] = sum over its top_k pairs of weight x act[pair] @ w2[expert]^T; one program per token, N tile."""
    n, k = out.shape[1], act.shape[1]
    assert act.stride(1) == 1 and w2.stride(2) == 1 and out.stride(1) == 1
    block_k = min(PAIR_BLOCK_K, triton.next_power_of_2(k))
    vec = max(1, min(16 // w2.element_size(), block_k))
    pdl = use_pdl(act.device)
    _moe_pair_down_sum_kernel[(out.shape[0], triton.cdiv(n, block_n))](
        act, w2, out, scale if scale is not None else w2, topk_weights, topk_ids,
        expert_map if expert_map is not None else topk_ids,
        n, k, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), scale.stride(0) if scale is not None else 0,
        TOP_K=top_k, HAS_SCALE=scale is not None, HAS_MAP=expert_map is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, VEC=vec, USE_PDL=pdl, num_warps=4, launch_pdl=bool(pdl),
    )


def moe_pair_gemv(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor, top_k: int, gated: bool,
    expert_map: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
    scale: torch.Tensor | None = None, block_n: int = PAIR_BLOCK_N, split_major: bool = False,
) -> None:
    """out[pair] = (silu(gate) * up of) a's row against the pair's expert in w; one program per pair and N tile.
    split_major (down): out[j * tokens + t] for token t's choice j instead."""
    n, k = out.shape[1], a.shape[1]
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    block_k = min(PAIR_BLOCK_K, triton.next_power_of_2(k))
    vec = max(1, min(16 // w.element_size(), block_k))
    pdl = use_pdl(a.device)
    _moe_pair_gemv_kernel[(out.shape[0], triton.cdiv(n, block_n))](
        a, w, out, scale if scale is not None else w, topk_weights if topk_weights is not None else out,
        topk_ids, expert_map if expert_map is not None else topk_ids,
        n, k, top_k, n, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        scale.stride(0) if scale is not None else 0, out.shape[0] // top_k,
        GATED=gated, MUL_WEIGHT=topk_weights is not None, HAS_SCALE=scale is not None, HAS_MAP=expert_map is not None,
        SPLIT_MAJOR=split_major, BLOCK_N=block_n, BLOCK_K=block_k, VEC=vec, USE_PDL=pdl, num_warps=4,
        launch_pdl=bool(pdl),
    )


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, scale_ptr, topk_w_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_pairs, top_k, up_offset,
    stride_am, stride_we, stride_wn, stride_om, stride_se,
    GATED: tl.constexpr, ROWS_ARE_TOKENS: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pdl_wait(USE_PDL)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    valid = pair < num_pairs
    row = (pair // top_k) if ROWS_ARE_TOKENS else pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up += tl.dot(a, w_up.to(a.dtype), input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_mask, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(scale_ptr + expert * stride_se + up_offset + offs_n, mask=n_mask, other=0.0)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc *= tl.load(topk_w_ptr + pair, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def moe_gemm(
    a: torch.Tensor,  # [rows, K]: tokens (gated) or pairs
    w: torch.Tensor,  # [E, N or 2N, K]
    out: torch.Tensor,  # [pairs, N]
    aligned: AlignedTokens,
    tile: MoETile,
    top_k: int,
    gated: bool,
    topk_weights: torch.Tensor | None = None,  # [pairs] fp32: scales each output row
    scale: torch.Tensor | None = None,  # [E, N or 2N] fp32 with FP8 weights
) -> None:
    n = out.shape[1]
    k = a.shape[1]
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    grid = (aligned.expert_ids.shape[0], triton.cdiv(n, tile.block_n))
    pdl = use_pdl(a.device)
    _moe_gemm_kernel[grid](
        a, w, out, scale if scale is not None else w, topk_weights if topk_weights is not None else out,
        aligned.sorted_pair_ids, aligned.expert_ids, aligned.num_padded,
        n, k, out.shape[0], top_k, n,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), scale.stride(0) if scale is not None else 0,
        GATED=gated, ROWS_ARE_TOKENS=gated, MUL_WEIGHT=topk_weights is not None, HAS_SCALE=scale is not None,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", USE_PDL=pdl,  # fp32 models: no TF32 rounding
        num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=bool(pdl),
    )


def fused_moe_triton(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_local_experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [num_local_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32
    expert_map: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    tile: MoETile | None = None,
    pair_path: bool | None = None,  # None: by token count (use_pair_path)
    into_norm: bool = False,  # the output goes only into a residual add + RMSNorm: PartialSums are fine
) -> torch.Tensor | PartialSums:  # [num_tokens, hidden]
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    num_global = expert_map.shape[0] if expert_map is not None else num_experts
    if pair_path is None:
        pair_path = tile is None and use_pair_path(num_tokens, top_k, num_global)
    if pair_path:
        ids = topk_ids.reshape(-1)
        if ids.dtype != torch.int32 or not ids.is_contiguous():
            ids = ids.to(torch.int32).contiguous()
        block_n, down = pair_config()
        weights = topk_weights.reshape(-1).float().contiguous()
        act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
        moe_pair_gemv(x, w13, act, ids, top_k, gated=True, expert_map=expert_map, scale=w13_scale, block_n=block_n)
        if down != "sum":  # every pair's weighted down row (another rank's expert: zeros), summed in top_k order
            partials = down == "norm" and into_norm
            rows = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
            moe_pair_gemv(act, w2, rows, ids, top_k, gated=False, expert_map=expert_map, topk_weights=weights,
                          scale=w2_scale, block_n=block_n, split_major=partials)
            if partials:  # [top_k, tokens, hidden]: the norm after the block adds them in top_k order
                return PartialSums(rows.view(top_k, num_tokens, hidden), None, None, x.dtype)
            return rows.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
        moe_pair_down_sum(act, w2, out, ids, weights, top_k, expert_map, w2_scale, block_n=block_n)
        return out
    tile = tile or moe_tile(num_tokens, top_k, num_experts)
    if num_tokens * top_k <= ALIGN_KERNEL_MAX_PAIRS:
        aligned = align_by_expert_triton(topk_ids, num_experts, tile.block_m, expert_map)
    else:
        aligned = align_by_expert(topk_ids, num_experts, tile.block_m, expert_map)
    num_pairs = num_tokens * top_k
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [pairs, inter]
    moe_gemm(x, w13, act, aligned, tile, top_k, gated=True, scale=w13_scale)
    # Pairs routed to another rank's experts are never written: zeros make them add nothing.
    alloc = torch.zeros if expert_map is not None else torch.empty
    down = alloc(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [pairs, hidden]
    moe_gemm(act, w2, down, aligned, tile, top_k, gated=False, topk_weights=topk_weights.reshape(-1).float(),
             scale=w2_scale)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
