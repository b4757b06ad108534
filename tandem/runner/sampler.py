"""Sampler: greedy, temperature, top-k / top-p and log-probabilities on device tensors, no host sync.

Random rows use an exponential race (argmax of p / E with E ~ Exp(1)) whose noise is a counter-based
hash of (request seed, token position, vocab index). A request's samples therefore depend only on its
seed and its own logits, never on which other requests share the batch or on the step order, so sync
and overlap runs sample the same tokens and seeded requests are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.ops import use_triton

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values < 2**32 (multipliers < 2**31: no overflow)."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK32
    x = ((x ^ (x >> 16)) * 0x297A2D39) & _MASK32
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 samples of Exp(1), a pure function of (seed, position, vocab index)."""
    row_key = _hash32((seeds & _MASK32) ^ _hash32(positions.to(torch.int64) & _MASK32))  # [B]
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [V]
    bits = _hash32(row_key[:, None] ^ _hash32(vocab + 0x9E3779B))  # [B, V]
    # The top 23 bits: every (k + 0.5) / 2**23 is exact in float32 (24 significant bits) and strictly inside
    # (0, 1). More bits round the top values to 1.0, i.e. noise 0: an infinite race for an allowed token, and
    # 0 / 0 = NaN, which wins the argmax, for a masked one.
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)
    return -torch.log(uniform)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Masks logits outside each row's top-k, top-p and min-p set with -inf; top_k <= 0, top_p == 1 and
    min_p == 0 disable. min-p keeps tokens whose probability is at least min_p times the top one's: a ratio,
    so it is the same before or after the other two filters (the top token always survives them)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [B, V]
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).to(torch.int64)  # [B]
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [B, 1]
    keep_sorted = sorted_logits >= kth
    probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    # Keep a token while the mass before it is < top_p (the first token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    keep_sorted &= mass_before < top_p[:, None]
    if min_p is not None:
        keep_sorted &= sorted_logits >= sorted_logits[:, :1] + torch.log(min_p)[:, None]
    keep = torch.empty_like(keep_sorted).scatter_(1, sorted_idx, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of [B, V] rows: on CUDA a two-stage Triton kernel that spreads each row over the GPU
    (torch reduces a row in one block: ~35 us for a 128K vocabulary on an H200), else torch."""
    if use_triton(x) and x.dim() == 2:
        from tandem.kernels.triton_argmax import argmax_rows_triton  # lazy: CPU runs never import Triton

        return argmax_rows_triton(x)
    return x.argmax(dim=-1)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, the chosen token's
    top_ids: torch.Tensor | None  # [B, n] int64
    top_logprobs: torch.Tensor | None  # [B, n] float32


def sample(
    logits: torch.Tensor,  # [B, V] model dtype (bf16 / fp16 / fp32)
    temperature: torch.Tensor,  # [B] float32, 0 = greedy
    top_k: torch.Tensor,  # [B] int32
    top_p: torch.Tensor,  # [B] float32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] position of the token being sampled
    all_greedy: bool,
    any_top_k_top_p: bool,
    num_logprobs: int,  # -1: none; 0: the chosen token's only; n: plus the top n
    min_p: torch.Tensor | None = None,  # [B] float32, 0 = off (read only with any_top_k_top_p)
) -> SamplerOutput:
    # Greedy reads the logits as they are: bf16 -> fp32 is exact, so the argmax (first index on ties) is the
    # same, without a float32 copy of a [B, vocab] tensor. Everything else computes in float32.
    greedy_ids = argmax_rows(logits)
    if all_greedy:
        token_ids = greedy_ids
    else:
        logits = logits.float()
        greedy = temperature == 0.0
        scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
        if any_top_k_top_p:
            scaled = apply_top_k_top_p(scaled, top_k, top_p, min_p)
        probs = torch.softmax(scaled, dim=-1)
        race = probs / exponential_noise(seeds, positions, logits.shape[-1])
        token_ids = torch.where(greedy, greedy_ids, argmax_rows(race))
    if num_logprobs < 0:
        return SamplerOutput(token_ids, None, None, None)
    logprobs_all = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs_all.gather(1, token_ids[:, None])[:, 0]
    if num_logprobs == 0:
        return SamplerOutput(token_ids, chosen, None, None)
    top_logprobs, top_ids = logprobs_all.topk(num_logprobs, dim=-1)
    return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)
