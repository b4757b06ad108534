"""Mixture-of-experts routing (softmax, top-k), the token sort/align by expert, and the plain-PyTorch MoE reference.

Everything here runs from device tensors with shapes fixed by the token count alone: no `.item()`, no host-side
count, so a decode step that routes captures into a CUDA graph and the step stays asynchronous.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def route_topk(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every expert (fp32), then the top_k; renormalize divides the chosen weights by their sum
    (Mixtral always, Qwen-MoE with norm_topk_prob). Returns (weights [n, top_k] fp32, expert ids [n, top_k] int32)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@dataclass(frozen=True, slots=True)
class AlignedTokens:
    """Token-expert pairs sorted by expert, each expert's run padded to a multiple of block_m.

    Pair p = token * top_k + k (a row of topk_ids.flatten()); the pad value is num_pairs. Block b of
    sorted_pair_ids belongs to expert_ids[b] (-1: no local expert, or past the used blocks)."""

    sorted_pair_ids: torch.Tensor  # [max_blocks * block_m] int32
    expert_ids: torch.Tensor  # [max_blocks] int32
    num_padded: torch.Tensor  # [1] int32: positions of sorted_pair_ids in use (a multiple of block_m)
    block_m: int


def max_aligned_blocks(num_pairs: int, num_buckets: int, block_m: int) -> int:
    """Blocks that any routing of num_pairs pairs over num_buckets experts can need (a bound from shapes only):
    sum over experts of ceil(c_e / block_m) <= ceil(num_pairs / block_m) + (experts that get a pair)."""
    return -(-num_pairs // block_m) + min(num_buckets, num_pairs)


def align_by_expert(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32, global expert ids
    num_experts: int,  # experts this rank holds
    block_m: int,
    expert_map: torch.Tensor | None = None,  # [num_global_experts] int32: local id, or -1 for another rank's
) -> AlignedTokens:
    """Sorts the token-expert pairs by (local) expert on the device and pads each expert's run to block_m.

    Pairs whose expert lives on another rank go to an extra bucket whose blocks get expert id -1 (skipped by the
    GEMMs, their rows written as zeros). Stable order: within an expert, pairs keep their index order."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [num_pairs]
    num_pairs = flat.shape[0]
    num_buckets = num_experts + 1  # the last: pairs of experts held elsewhere
    if expert_map is not None:
        local = expert_map.long()[flat]
        flat = torch.where(local < 0, num_experts, local)
    counts = torch.zeros(num_buckets, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # not bincount: its output size would need a sync
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first_of = torch.cumsum(counts, 0) - counts  # index of each expert's first pair in sorted order
    order = torch.sort(flat, stable=True).indices  # [num_pairs]
    sorted_experts = flat[order]
    dest = starts[sorted_experts] + torch.arange(num_pairs, device=device) - first_of[sorted_experts]
    max_blocks = max_aligned_blocks(num_pairs, num_buckets, block_m)
    sorted_pair_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(ends, block_starts, right=True)  # the bucket whose run holds the block
    expert_ids = torch.where(expert_ids >= num_experts, -1, expert_ids).to(torch.int32)
    num_padded = ends[num_experts - 1 : num_experts].to(torch.int32)  # local buckets only: the rest is skipped
    return AlignedTokens(sorted_pair_ids, expert_ids, num_padded, block_m)


def align_by_expert_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                        expert_map: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """Python reference of align_by_expert's used part: (sorted pair ids incl. padding, expert id per block)."""
    flat = topk_ids.reshape(-1).tolist()
    local = [int(expert_map[e]) if expert_map is not None else e for e in flat]
    pairs, experts = [], []
    for e in range(num_experts):
        mine = [p for p, x in enumerate(local) if x == e]
        num_blocks = -(-len(mine) // block_m)
        pairs += mine + [len(flat)] * (num_blocks * block_m - len(mine))
        experts += [e] * num_blocks
    return pairs, experts


def fused_moe_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_local_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_local_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32, global ids
    expert_map: torch.Tensor | None = None,  # [num_global_experts] int32: local id or -1
    w13_scale: torch.Tensor | None = None,  # [num_local_experts, 2 * inter] fp32 with FP8 weights
    w2_scale: torch.Tensor | None = None,  # [num_local_experts, hidden] fp32
    # (local expert, its silu(gate) * up [tokens, inter]) -> the columns its down weight reads (act-order experts
    # over ranks; called for every local expert, in order)
    act_columns: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:  # [num_tokens, hidden] in x's dtype: sum over k of weight_k * expert_k(x)
    """Per-expert loop over every local expert with the token-expert weights as a mask (exact, no host count):
    a token an expert does not serve gets weight 0 and its row of the product is discarded."""
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]  # -1 for experts elsewhere: matches no local e
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        weight = (topk_weights * (ids == e)).sum(dim=-1)  # [num_tokens]
        gate_up = _expert_weight(w13[e], w13_scale, e, x.dtype)
        down = _expert_weight(w2[e], w2_scale, e, x.dtype)
        h = x @ gate_up.t()
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up
        y = (act if act_columns is None else act_columns(e, act)) @ down.t()
        out += weight[:, None] * y.float()
    return out.to(x.dtype)


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w
    return (w.float() * scale[e][:, None]).to(dtype)
