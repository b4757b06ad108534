"""The EAGLE-3 head's two device steps on static buffers: feeding rows of the target's hidden states (each row one
query over its sequence's paged head KV) and chaining drafts from each request's last row. On a GPU each replays a
CUDA graph captured per row bucket; elsewhere (or with graphs off) the same code runs as it is."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.speculative.eagle3_head import Eagle3Head


def row_buckets(max_rows: int) -> list[int]:
    """Row counts a step is padded to: powers of two below max_rows, and max_rows."""
    sizes = [1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows]
    return [*sizes, max_rows]


def bucket(rows: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= rows)


def scratch_blocks_per_row(block_size: int, max_drafts: int) -> int:
    """Head KV blocks a chain row owns: from its last position's block start to the chain's last written position
    (a copy of that partial block, then up to max_drafts - 1 chain positions)."""
    return max(1, -(-(block_size + max_drafts - 2) // block_size))


@dataclass(slots=True)
class IntsLayout:
    """Offsets of a step's int64 inputs for a bucket of `rows` rows: `regions` vectors of one value a row, then each
    row's block table (rows x width). A feed's regions: tokens, positions, slots, aux rows and the rows whose output
    streams are kept; a chain's: positions (of its first row), the block copied into the row's first scratch block
    and that block."""

    rows: int
    width: int
    regions: int

    def region(self, index: int) -> slice:
        return slice(index * self.rows, (index + 1) * self.rows)

    @property
    def tables(self) -> slice:
        start = self.regions * self.rows
        return slice(start, start + self.rows * self.width)

    @property
    def size(self) -> int:
        return self.tables.stop


FEED_REGIONS, CHAIN_REGIONS = 5, 3


def feed_layout(rows: int, width: int) -> IntsLayout:
    return IntsLayout(rows, width, FEED_REGIONS)


def chain_layout(rows: int, width: int) -> IntsLayout:
    return IntsLayout(rows, width, CHAIN_REGIONS)


class HeadSteps:
    """Static inputs and outputs of the head's feed (up to `feed_rows` rows in one-row-per-query layout) and chain
    (up to `chain_rows` requests, `max_drafts` drafts each), and their graphs once `capture` ran."""

    def __init__(self, head: Eagle3Head, kv: torch.Tensor, block_size: int, max_blocks: int, chain_rows: int,
                 max_drafts: int, feed_rows: int, scratch_blocks: int) -> None:
        c = head.config
        self.head, self.kv, self.block_size = head, kv, block_size  # kv [2, blocks, block_size, kv heads, dim]
        self.max_drafts = max_drafts
        self.scratch_rows, self.scratch_blocks = chain_rows, scratch_blocks  # the last blocks of kv
        self.feed_width = max_blocks
        self.chain_width = max_blocks + scratch_blocks  # a chain row's table: its blocks, then its scratch blocks
        device = kv.device
        self.feed_buckets, self.chain_buckets = row_buckets(feed_rows), row_buckets(chain_rows)
        self.feed_ints = torch.zeros(feed_layout(feed_rows, self.feed_width).size, dtype=torch.int64, device=device)
        self.feed_aux = torch.zeros(feed_rows, 3 * c.target_hidden_size, dtype=kv.dtype, device=device)
        self.chain_ints = torch.zeros(chain_layout(chain_rows, self.chain_width).size, dtype=torch.int64,
                                      device=device)
        self.chain_stream = torch.zeros(chain_rows, c.hidden_size, dtype=kv.dtype, device=device)
        self.chain_tokens = torch.zeros(chain_rows, max_drafts, dtype=torch.int64, device=device)
        self.starts = torch.arange(max(feed_rows, chain_rows) + 1, dtype=torch.int32, device=device)
        self.feed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.chain_graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def release(self) -> None:
        self.feed_graphs, self.chain_graphs = {}, {}
        for name in ("kv", "feed_ints", "feed_aux", "chain_ints", "chain_stream", "chain_tokens"):
            setattr(self, name, getattr(self, name).new_empty(0))

    # ---------------------------------------------------------------- the steps (graph-safe: static shapes only)

    def _meta(self, slots: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
        """One query per row at `positions`, attending to positions 0 .. its own through its table."""
        n = slots.shape[0]
        return AttentionMetadata(slot_mapping=slots, query_start_loc=self.starts[: n + 1],
                                 seq_lens=(positions + 1).to(torch.int32), block_tables=tables, max_query_len=1,
                                 max_seq_len=tables.shape[1] * self.block_size)

    def _feed(self, r: int) -> torch.Tensor:
        lay, ints = feed_layout(r, self.feed_width), self.feed_ints
        tokens, positions, slots = ints[lay.region(0)], ints[lay.region(1)], ints[lay.region(2)]
        tables = ints[lay.tables].view(r, self.feed_width).to(torch.int32)
        hidden = self.head.fuse(self.feed_aux[:r])
        return self.head.layer_rows(tokens, hidden, positions, self.kv, self._meta(slots, positions, tables))

    def _chain(self, b: int) -> None:
        lay, ints, bs, head = chain_layout(b, self.chain_width), self.chain_ints, self.block_size, self.head
        positions, source, scratch = ints[lay.region(0)], ints[lay.region(1)], ints[lay.region(2)]
        tables = ints[lay.tables].view(b, self.chain_width)
        # The block holding the first chain position is copied into the row's scratch block, which the table
        # names in its place: the chain writes its KV there, never into a block the target holds.
        self.kv.index_copy_(1, scratch, self.kv.index_select(1, source))
        tables32 = tables.to(torch.int32)
        stream = self.chain_stream[:b]
        token = head.draft(stream)
        self.chain_tokens[:b, 0] = token
        for j in range(1, self.max_drafts):
            pos = positions + (j - 1)
            slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
            stream = head.layer_rows(token, stream, pos, self.kv, self._meta(slots, pos, tables32))
            token = head.draft(stream)
            self.chain_tokens[:b, j] = token

    # ---------------------------------------------------------------- running them

    def feed(self, host_ints: np.ndarray, rows: int, aux: torch.Tensor, sampled: torch.Tensor | None = None,
             kept: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> torch.Tensor:
        """Runs a feed: host_ints in feed_layout(bucket, width) order; -> the kept rows' output streams (those of
        region 4, or the device indices `kept`). With `sampled`, the tokens are still on the device: row r's token
        is sampled[aux row of r] (the target's token after that row's position), not region 0's. With `shift`
        (per aux row, on the device), each row's position is that much before the host's, and its KV slot
        follows from its table."""
        r = bucket(rows, self.feed_buckets)
        lay = feed_layout(r, self.feed_width)
        self.feed_ints[: lay.size].copy_(pinned(host_ints), non_blocking=True)
        aux_rows = self.feed_ints[lay.region(3)]
        if sampled is not None:
            self.feed_ints[lay.region(0)].copy_(sampled.index_select(0, aux_rows))
        if shift is not None:
            positions, slots, bs = self.feed_ints[lay.region(1)], self.feed_ints[lay.region(2)], self.block_size
            live = slots >= 0  # padding rows write nothing and stay at position 0
            positions.sub_(torch.where(live, shift.index_select(0, aux_rows), 0))
            tables = self.feed_ints[lay.tables].view(r, self.feed_width)
            moved = tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
            slots.copy_(torch.where(live, moved, slots))
        torch.index_select(aux, 0, aux_rows, out=self.feed_aux[:r])
        graph = self.feed_graphs.get(r)
        if graph is not None:
            graph[0].replay()
            out = graph[1]
        else:
            out = self._feed(r)
        return out.index_select(0, self.feed_ints[lay.region(4)] if kept is None else kept)

    def chain_after_verify(self, base: np.ndarray, blocks: np.ndarray, accepted: torch.Tensor, rows: int,
                           streams: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        """A chain whose first positions are only known on the device: row b starts at base[b] + accepted[b]
        (base: the position after its verified run's first position; accepted: its kept drafts, [rows] on the
        device), less shift[b] where given (the verified run's own move back, ModelExecutor.shift_rows); blocks
        [rows, chain_width] its block table. The row's table and the block copied into its first scratch block
        follow from that position as `chain`'s host inputs would (Eagle3Proposer._chain_ints).
        -> the rows' drafts [rows, max_drafts] on the device."""
        b, bs, width = bucket(rows, self.chain_buckets), self.block_size, self.chain_width
        lay = chain_layout(b, width)
        device = self.chain_ints.device
        scratch = self.kv.shape[1] - self.scratch_rows * self.scratch_blocks  # the first chain row's scratch
        own = torch.arange(b, device=device) * self.scratch_blocks + scratch
        padded = np.zeros((b, width), dtype=np.int64)
        padded[:rows] = blocks
        starts = np.zeros(b, dtype=np.int64)
        starts[:rows] = base
        table = pinned(padded).to(device, non_blocking=True)
        pos = pinned(starts).to(device, non_blocking=True)
        pos[:rows] += accepted[:rows]
        if shift is not None:
            pos[:rows] -= shift[:rows]
        full = (pos // bs)[:, None]
        col = torch.arange(width, device=device)[None, :]
        chained = torch.where(col < full, table, own[:, None] + col - full)
        chained = torch.where(col < full + self.scratch_blocks, chained, 0)
        source = torch.where(pos % bs != 0, table.gather(1, full)[:, 0], own)
        ints = self.chain_ints
        ints[lay.region(0)].copy_(pos)
        ints[lay.region(1)].copy_(source)
        ints[lay.region(2)].copy_(own)
        ints[lay.tables].copy_(chained.reshape(-1))
        return self._run_chain(b, rows, streams)

    def chain(self, host_ints: np.ndarray, rows: int, streams: list[torch.Tensor]) -> torch.Tensor:
        """Runs a chain: host_ints in chain_layout(bucket, width) order, each row's last output stream; -> the
        rows' drafts [rows, max_drafts] (target ids, on the device)."""
        b = bucket(rows, self.chain_buckets)
        self.chain_ints[: chain_layout(b, self.chain_width).size].copy_(pinned(host_ints), non_blocking=True)
        return self._run_chain(b, rows, torch.stack(streams))

    def _run_chain(self, b: int, rows: int, streams: torch.Tensor) -> torch.Tensor:
        self.chain_stream[:rows].copy_(streams)
        graph = self.chain_graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            self._chain(b)
        return self.chain_tokens[:rows]

    def capture(self, stream: torch.cuda.Stream) -> None:
        """CUDA graphs of every feed and chain bucket (warmed up first: kernels compile outside a capture), largest
        first in one pool. Their inputs are zero: block 0 (never a request's) takes the writes."""
        self.feed_ints.zero_()
        self.chain_ints.zero_()
        steps: list[tuple[str, int, Callable[[], object]]] = [
            *(("feed", r, lambda r=r: self._feed(r)) for r in reversed(self.feed_buckets)),
            *(("chain", b, lambda b=b: self._chain(b)) for b in reversed(self.chain_buckets))]
        with torch.cuda.stream(stream), torch.inference_mode():
            for _, _, fn in steps:
                fn()
        stream.synchronize()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for kind, rows, fn in steps:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = fn()
                if kind == "feed":
                    assert isinstance(out, torch.Tensor)
                    self.feed_graphs[rows] = (graph, out)
                else:
                    self.chain_graphs[rows] = graph
        stream.synchronize()


def pinned(values: np.ndarray) -> torch.Tensor:
    """A host tensor the device copies from without waiting for its stream (pinned: a pageable source may make the
    copy wait for the step in flight); PyTorch keeps the block until that copy is done."""
    host = torch.from_numpy(values)
    return host.pin_memory() if torch.cuda.is_available() else host


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
