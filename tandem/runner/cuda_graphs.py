"""CUDA graphs: for decode steps, one per (slot, padded batch size), captured largest first in one pool, plus
one small sampling graph per (slot, padded batch size, sampler variant) in the same pool; for steps that mix
prefills into the decodes, piecewise graphs per (slot, token bucket) with attention launched between pieces."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import NamedTuple

import torch

from tandem.kernels import ops
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.layers.attention import Attention, split_at_attention


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
        pool: object | None = None,  # another DecodeGraphs' pool to share
    ) -> None:
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.sample_graphs: dict[tuple[int, int, SamplerVariant], torch.cuda.CUDAGraph] = {}
        self.pool = pool = pool if pool is not None else torch.cuda.graph_pool_handle()
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

    def release(self) -> None:
        """Destroys every graph now (the device must be idle). A graph that captured NCCL kernels holds a
        reference on the communicator, and ncclCommDestroy / ncclCommAbort wait until it is gone, so the
        tensor-parallel shutdown calls this before it destroys the process group."""
        for graph in (*self.graphs.values(), *self.sample_graphs.values()):
            graph.reset()
        self.graphs.clear()
        self.sample_graphs.clear()
        self.logits.clear()
        self.pool = None


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Token buckets of the piecewise graphs: multiples of 8 up to 64, then steps of a quarter of the power of
    two below (a step pads at most a fifth of its tokens), up to max_tokens (always included)."""
    sizes: list[int] = []
    size = 8
    while size < max_tokens:
        sizes.append(size)
        size += 8 if size < 32 else (1 << (size.bit_length() - 1)) // 4
    sizes.append(max_tokens)
    return sizes


class _Splitter:
    """The attention hook while pieces are captured: q goes into the shared static q buffer inside the piece
    that computed it (written there by the rotary kernel through q_out, else copied), then the piece ends,
    the next begins, and the caller gets the static output buffer that the eager attention will fill at
    replay."""

    def __init__(self, max_tokens: int, pool: object) -> None:
        self.max_tokens = max_tokens
        self.pool = pool
        self.q_buf: torch.Tensor | None = None
        self.out_buf: torch.Tensor | None = None
        self.layers: list[tuple[Attention, torch.Tensor, torch.Tensor]] = []
        self.graph: torch.cuda.CUDAGraph | None = None  # the piece being captured; None while warming up
        self.pieces: list[torch.cuda.CUDAGraph] = []

    def q_out(self, q: torch.Tensor) -> torch.Tensor:
        """The static q rows [num_tokens, heads, head_dim] the eager attention reads for a q shaped like `q`."""
        if self.q_buf is None:  # first warm-up call, outside any capture: plain allocations
            self.q_buf = torch.empty(self.max_tokens, *q.shape[1:], dtype=q.dtype, device=q.device)
            self.out_buf = torch.zeros_like(self.q_buf)
        elif self.q_buf.shape[1:] != q.shape[1:] or self.q_buf.dtype != q.dtype:
            raise RuntimeError(f"piecewise graphs need one q shape for every layer, got {tuple(q.shape)} after "
                               f"{tuple(self.q_buf.shape)}")
        return self.q_buf[: q.shape[0]]

    def __call__(self, layer: Attention, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor:
        num_tokens = q.shape[0]
        q_rows = self.q_out(q)
        if q.data_ptr() != q_rows.data_ptr() or q.stride() != q_rows.stride():
            q_rows.copy_(q)
        self.layers.append((layer, k_cache, v_cache))
        if self.graph is not None:
            self.graph.capture_end()
            self.pieces.append(self.graph)
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=self.pool)
        return self.out_buf[:num_tokens]  # type: ignore[index]


class PiecewiseGraphs:
    """CUDA graphs for steps that mix prefill chunks into the decodes, up to a token bucket.

    The attention of such a step has a grid that depends on its query lengths, so it cannot be captured;
    everything else can. `forward_fn(slot, num_tokens)` enqueues carry-over + the model's forward on the
    slot's static buffers and returns the final hidden states. Captured per (slot, bucket) with every
    Attention.attend routed to a splitter, it becomes layers + 1 graphs ("pieces"); at replay the pieces run
    in order with the real attention launched eagerly between them, reading the shared static q buffer and
    writing the shared static output buffer that the next piece reads. Padding rows (slot_mapping -1,
    position 0) compute rows nobody reads, as in the decode graphs. The pieces share the decode graphs'
    memory pool: no two replays ever overlap on the compute stream.
    """

    def __init__(
        self,
        forward_fn: Callable[[int, int], torch.Tensor],
        sizes: list[int],
        stream: torch.cuda.Stream,
        pool: object,
    ) -> None:
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        self.pieces: dict[tuple[int, int], list[torch.cuda.CUDAGraph]] = {}
        splitter = _Splitter(self.max_tokens, pool)
        with split_at_attention(splitter), torch.cuda.stream(stream):
            for num_tokens in reversed(self.sizes):  # warm-up: kernels compile outside capture
                hidden = forward_fn(0, num_tokens)
            # The last piece copies its hidden states here: one static buffer for every bucket and slot.
            self.hidden_buf = torch.empty(self.max_tokens, *hidden.shape[1:], dtype=hidden.dtype,
                                          device=hidden.device)
            del hidden
            stream.synchronize()
            self.layers = splitter.layers[: len(splitter.layers) // len(self.sizes)]
            for num_tokens in reversed(self.sizes):  # largest first, as the decode graphs
                for slot in (0, 1):
                    splitter.layers, splitter.pieces = [], []
                    splitter.graph = torch.cuda.CUDAGraph()
                    splitter.graph.capture_begin(pool=pool)
                    self.hidden_buf[:num_tokens].copy_(forward_fn(slot, num_tokens))
                    splitter.graph.capture_end()
                    if len(splitter.layers) != len(self.layers):
                        raise RuntimeError(f"the forward called attention {len(splitter.layers)} times at "
                                           f"{num_tokens} tokens, {len(self.layers)} times in warm-up")
                    self.pieces[slot, num_tokens] = [*splitter.pieces, splitter.graph]
            splitter.graph = None
        stream.synchronize()
        self.q_buf: torch.Tensor = splitter.q_buf  # type: ignore[assignment]
        self.out_buf: torch.Tensor = splitter.out_buf  # type: ignore[assignment]

    @property
    def num_graphs(self) -> int:
        return sum(len(p) for p in self.pieces.values())

    def padded_size(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, slot: int, num_tokens: int, padded: int, meta: AttentionMetadata) -> torch.Tensor:
        """Runs the step's forward (pieces + eager attention on the step's metadata); returns the hidden
        states [padded, hidden] (rows past num_tokens are padding)."""
        pieces = self.pieces[slot, padded]
        q, out = self.q_buf[:num_tokens], self.out_buf[:num_tokens]
        for piece, (layer, k_cache, v_cache) in zip(pieces, self.layers):
            piece.replay()
            ops.paged_attention(q, k_cache, v_cache, meta, layer.scale, out)
        pieces[-1].replay()
        return self.hidden_buf[:padded]

    def release(self) -> None:
        """Destroys every piece now (the device must be idle), as DecodeGraphs.release."""
        for pieces in self.pieces.values():
            for piece in pieces:
                piece.reset()
        self.pieces.clear()
        self.layers = []
