"""CUDA graphs for decode steps: one per (slot, padded batch size), captured largest first in one pool,
plus one small sampling graph per (slot, padded batch size, sampler variant) in the same pool."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import NamedTuple

import torch


class SamplerVariant(NamedTuple):
    """What a step's sampling computes; chosen on the host from the scheduled requests' parameters.

    Variants exist because the costly parts (the counter-based noise over [B, V], the full-vocab sort of
    top-k/top-p, log_softmax + top-n) would otherwise run for every batch, greedy ones included. A greedy
    row inside a random variant still takes the argmax, so any variant that covers a step samples the same
    tokens; the host picks the cheapest covering one, which needs no GPU sync.
    """

    random: bool  # some row has temperature > 0
    top_k_top_p: bool  # some random row filters (implies random)
    logprobs: bool  # some row asked for log-probabilities (the graph then computes the top MAX_LOGPROBS)


SAMPLER_VARIANTS = tuple(
    SamplerVariant(r, f, lp) for r in (False, True) for f in (False, True) for lp in (False, True) if r or not f
)


def sampler_variant(all_greedy: bool, any_top_k_top_p: bool, num_logprobs: int) -> SamplerVariant:
    return SamplerVariant(not all_greedy, (not all_greedy) and any_top_k_top_p, num_logprobs >= 0)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode steps. `step_fn(slot, batch_size)` enqueues carry-over + forward + logits on the
    current stream and returns the logits tensor; its inputs are the slot's static device buffers, so the
    graph replays on whatever the H2D copy last wrote there (seed 001: copy_, then replay()). Its output
    should be a view of one static buffer shared by all graphs (replays never overlap), so that no graph
    keeps a private logits tensor alive in the pool.

    `sample_fn(slot, batch_size, variant)` (optional) enqueues sampling of that static logits buffer with the
    slot's static per-row parameters into the slot's static output buffers; it is captured per variant as
    its own small graph, replayed right after the forward graph. Separate graphs (rather than variants of
    the whole forward) keep the forward captured once per size: the six sampling variants add only their
    own few kernels per size, and all graphs share one memory pool.
    """

    def __init__(
        self,
        step_fn: Callable[[int, int], torch.Tensor],
        batch_sizes: list[int],
        stream: torch.cuda.Stream,
        sample_fn: Callable[[int, int, SamplerVariant], None] | None = None,
    ) -> None:
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.sample_graphs: dict[tuple[int, int, SamplerVariant], torch.cuda.CUDAGraph] = {}
        pool = torch.cuda.graph_pool_handle()
        # Warm-up at every size: kernels compile (and load their modules) per variant, which CUDA
        # forbids during capture, and the attention kernels pick variants by batch size.
        with torch.cuda.stream(stream):
            for batch_size in reversed(self.batch_sizes):
                for slot in (0, 1):
                    step_fn(slot, batch_size)
            if sample_fn is not None:
                for variant in SAMPLER_VARIANTS:
                    for batch_size in {self.batch_sizes[0], self.batch_sizes[-1]}:
                        sample_fn(0, batch_size, variant)
        stream.synchronize()
        # Largest first, so that smaller graphs reuse the larger ones' memory in the shared pool.
        for batch_size in reversed(self.batch_sizes):
            for slot in (0, 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[slot, batch_size] = step_fn(slot, batch_size)
                self.graphs[slot, batch_size] = graph
        if sample_fn is not None:
            for batch_size in reversed(self.batch_sizes):
                for slot in (0, 1):
                    for variant in SAMPLER_VARIANTS:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool, stream=stream):
                            sample_fn(slot, batch_size, variant)
                        self.sample_graphs[slot, batch_size, variant] = graph
        stream.synchronize()

    @property
    def captures_sampling(self) -> bool:
        return bool(self.sample_graphs)

    def padded_size(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def replay(self, slot: int, batch_size: int) -> torch.Tensor:
        self.graphs[slot, batch_size].replay()
        return self.logits[slot, batch_size]

    def replay_sample(self, slot: int, batch_size: int, variant: SamplerVariant) -> None:
        """Samples the rows of the last replay's logits into the slot's static output buffers."""
        self.sample_graphs[slot, batch_size, variant].replay()
