"""CUDA graphs for decode steps: one per (slot, padded batch size), captured largest first in one pool."""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch


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
    keeps a private logits tensor alive in the pool."""

    def __init__(
        self,
        step_fn: Callable[[int, int], torch.Tensor],
        batch_sizes: list[int],
        stream: torch.cuda.Stream,
    ) -> None:
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        # Warm-up at every size: kernels compile (and load their modules) per variant, which CUDA
        # forbids during capture, and the attention kernels pick variants by batch size.
        with torch.cuda.stream(stream):
            for batch_size in reversed(self.batch_sizes):
                for slot in (0, 1):
                    step_fn(slot, batch_size)
        stream.synchronize()
        # Largest first, so that smaller graphs reuse the larger ones' memory in the shared pool.
        for batch_size in reversed(self.batch_sizes):
            for slot in (0, 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[slot, batch_size] = step_fn(slot, batch_size)
                self.graphs[slot, batch_size] = graph
        stream.synchronize()

    def padded_size(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def replay(self, slot: int, batch_size: int) -> torch.Tensor:
        self.graphs[slot, batch_size].replay()
        return self.logits[slot, batch_size]
