"""EAGLE-3 proposer: feeds the head every collected step's hidden states (its one layer's KV lives in a cache of its
own under the target's block ids) and drafts a request's next tokens by chaining the head on its own output."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.request import Request, RequestStatus
from tandem.scheduler.output import SchedulerOutput, ScheduledRequest, row_stand_ins
from tandem.speculative.eagle3_head import Eagle3Head
from tandem.speculative.eagle3_rows import (
    HeadSteps,
    chain_layout,
    feed_layout,
    pinned,
    bucket,
    on_stream,
    scratch_blocks_per_row,
)

@dataclass(slots=True)
class _Last:
    """A request's latest head row whose next token was known: its position and output stream [hidden]."""

    request: Request
    blocks: list[int]  # its block table when fed (positions up to `position` keep their blocks while it runs)
    position: int
    stream: torch.Tensor


def step_rows(sched: SchedulerOutput, flat: bool) -> Iterator[tuple[ScheduledRequest, list[int]]]:
    """Each scheduled request with the rows of its positions start.. start + n - 1 in the step's token rows (the
    aux hidden states): in order, or, for a flat verify step, the last position at row i and the draft positions
    after all sequences' rows (input_buffers.write_flat_verify)."""
    scheduled = sched.scheduled
    offset = len(scheduled) if flat else 0
    for i, s in enumerate(scheduled):
        n = s.num_scheduled_tokens
        if flat:
            k = s.num_draft
            yield s, [*range(offset, offset + k), i]
            offset += k
        else:
            yield s, list(range(offset, offset + n))
            offset += n


def _ints(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 values on the device without waiting for the device (pinned source; see eagle3_rows.pinned)."""
    return pinned(values).to(device, non_blocking=True)


class Eagle3Proposer:
    """Greedy chain drafts from an EAGLE-3 head. `observe` runs the head over the rows a collected target step
    computed whose next token is known (prompt chunks, decodes, a verify step's accepted positions), writing its
    KV at their positions; `propose_all` chains it k times from each request's last row. Feeds of up to
    `feed_rows` rows and chains of up to `chain_rows` requests run on static buffers (eagle3_rows.HeadSteps, CUDA
    graphs once `capture` ran); longer feeds (prompt chunks) run as they come, one query row per position."""

    def __init__(self, head: Eagle3Head, num_blocks: int, block_size: int, stream: torch.cuda.Stream | None,
                 max_blocks: int | None = None, chain_rows: int = 16, max_drafts: int = 4,
                 feed_rows: int | None = None) -> None:
        c = head.config
        self.head, self.block_size, self.stream = head, block_size, stream
        self.chain_rows, self.scratch = chain_rows, scratch_blocks_per_row(block_size, max_drafts)
        self.first_scratch = num_blocks
        # [K / V, block, offset, kv heads, dim]: the target's block ids index it too, so a position's head KV
        # lives wherever the target keeps that position's KV (and prefix-cache hits find it); past them, each
        # chain row's scratch blocks.
        self.kv = torch.zeros(2, num_blocks + chain_rows * self.scratch, block_size, c.num_kv_heads, c.head_dim,
                              dtype=head.fc.dtype, device=head.fc.device)
        self.feed_rows = chain_rows * (max_drafts + 1) if feed_rows is None else feed_rows
        self.steps = HeadSteps(head, self.kv, block_size, max_blocks or num_blocks, chain_rows, max_drafts,
                               max(self.feed_rows, 1), self.scratch)
        self.last: dict[str, _Last] = {}
        # Verify steps fed and chained before the host learned their accepted counts (prefetch), oldest first (two
        # while a step is scheduled behind one in flight): each one's schedule and each group's output stream at
        # its last kept row. The chain's output holds the last one's drafts. Once observe kept the last one: the
        # chain row each request's drafts wait in (with the position it chained from).
        self._prefetched: list[tuple[SchedulerOutput, torch.Tensor]] = []
        self._ready: dict[str, tuple[int, int]] = {}

    def capture(self) -> None:
        """CUDA graphs for the feeds and chains that fit the static buffers (on the proposer's stream)."""
        assert self.stream is not None
        self.steps.capture(self.stream)

    def release(self) -> None:
        """Drops the head's weights, KV cache, graphs and kept rows, so that their memory can go back to the device
        (the engine is shut down: nothing is fed or proposed afterwards)."""
        self.head.release()
        self.steps.release()
        self.kv = torch.empty(0, device=self.kv.device)
        self.last = {}

    @torch.inference_mode()
    def prefetch(self, sched: SchedulerOutput, aux: torch.Tensor, sampled: torch.Tensor, accepted: torch.Tensor,
                 row_shift: torch.Tensor | None = None) -> bool:
        """Enqueued right behind a flat verify step (input_buffers.write_flat_verify), before the host waits for
        it: feeds the head every row of the step and chains from each request's last kept row, with the sampled
        tokens [rows] and accepted counts [sequences] the step leaves on the device, so the next step's drafts
        are drafted while the host collects this one. A row past a request's kept drafts is fed the token
        sampled there: its head KV lies past the positions the request keeps, and is written again before a
        chain reads it (a chain writes each position before attending to it). observe() then keeps what the
        host learns was accepted. row_shift [rows]: for a step written behind a verify step in flight, how far
        each row's positions moved back on the device (ModelExecutor.shift_rows); the host's positions here are
        those before the move. False, with nothing enqueued, where the step does not fit the static buffers."""
        groups = list(step_rows(sched, flat=True))
        n = sum(len(r) for _, r in groups)
        steps, bs = self.steps, self.block_size
        if not 0 < n <= self.feed_rows or len(groups) > self.chain_rows:
            return False
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        feeds: list[tuple[Request, list[int], int, int]] = []  # (request, block table, first row, rows)
        base = np.zeros(len(groups), dtype=np.int64)
        chain_tables = np.zeros((len(groups), steps.chain_width), dtype=np.int64)
        for g, (s, step_rows_) in enumerate(groups):
            start, end, blocks = s.num_computed_tokens, s.num_computed_tokens + len(step_rows_), s.block_ids
            feeds.append((s.request, blocks, len(rows), len(step_rows_)))
            chain_tables[g, : len(blocks)] = blocks
            base[g] = start + 1
            rows.extend(step_rows_)
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
        ints = self._feed_ints(rows, positions, None, slots, feeds)
        kept = accepted[: len(groups)]
        with on_stream(self.stream):
            last_rows = _ints(np.asarray([first for _, _, first, _ in feeds]), kept.device) + kept
            streams = steps.feed(ints, n, aux, sampled, last_rows, row_shift)
            shift = None if row_shift is None else row_shift[: len(groups)]  # own row g: group g's shift
            steps.chain_after_verify(base, chain_tables, kept, len(groups), streams, shift)
        self._prefetched = [*self._prefetched[-1:], (sched, streams)]
        self._ready = {}
        return True

    def drafts_ahead(self, sched: SchedulerOutput, ks: list[int], accepted: torch.Tensor | None = None
                     ) -> tuple[list[list[int]], torch.Tensor] | None:
        """Stand-ins for the drafts the chain behind the verify step `sched` (still in flight) is making: for
        its g-th request, the first ks[g] of chain row g, to verify in the step scheduled behind it
        (EngineCore._verify_ahead). -> (stand-ins per request, the chain's output on the device); None where that
        chain is not the last one enqueued. `accepted` (that step's accepted counts on the device) is not read:
        the chain started from them already."""
        if not self.prefetched(sched):
            return None
        width = self.steps.max_drafts
        return [row_stand_ins(g, k, width) for g, k in enumerate(ks)], self.steps.chain_tokens

    def prefetched(self, sched: SchedulerOutput) -> bool:
        """Whether the chain behind the verify step `sched` is the last one enqueued (drafts_ahead can use it)."""
        return bool(self._prefetched) and self._prefetched[-1][0] is sched

    def _keep_prefetched(self, sched: SchedulerOutput) -> bool:
        """observe() of a prefetched step: each running request's last kept row becomes its last fed row, and, if
        no chain ran after it, its drafts wait in the prefetched chain's row. False where `sched` was not
        prefetched."""
        found = next((i for i, (done, _) in enumerate(self._prefetched) if done is sched), None)
        if found is None:
            return False
        streams = self._prefetched[found][1]
        latest = found == len(self._prefetched) - 1
        del self._prefetched[: found + 1]
        bs = self.block_size
        for g, s in enumerate(sched.scheduled):
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue
            # The last kept position (its next token is the last this step produced).
            position = s.num_computed_tokens + request.num_new_tokens - 1
            if not s.num_computed_tokens <= position <= s.num_computed_tokens + s.num_draft:
                continue
            self.last[request.request_id] = _Last(request, s.block_ids[: position // bs + 1], position, streams[g])
            if latest:
                self._ready[request.request_id] = (g, position)
        return True

    @torch.inference_mode()
    def observe(self, sched: SchedulerOutput, flat: bool, aux: torch.Tensor) -> None:
        """Feeds the head a collected step's rows: aux [>= step rows, 3 x target hidden] (the slot's copy)."""
        self.last = {rid: e for rid, e in self.last.items() if e.request.status is RequestStatus.RUNNING}
        if self._keep_prefetched(sched):
            return
        self._ready = {}
        rows: list[int] = []
        positions: list[int] = []
        tokens: list[int] = []
        slots: list[int] = []
        groups: list[tuple[Request, list[int], int, int]] = []  # (request, block table, first row, rows)
        bs = self.block_size
        for s, step_rows_ in step_rows(sched, flat):
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue  # finished (its blocks may be gone) or preempted (the target computes it again)
            start, known = s.num_computed_tokens, request.all_token_ids
            # A row is fed once the token after its position is known, and only if the target kept its KV.
            end = min(start + s.num_scheduled_tokens, request.num_computed_tokens, len(known) - 1)
            if end <= start:
                continue
            blocks = s.block_ids[: -(-end // bs)]  # those of positions < end (all the rows read)
            groups.append((request, blocks, len(rows), end - start))
            rows.extend(step_rows_[: end - start])
            positions.extend(range(start, end))
            tokens.extend(known[start + 1 : end + 1])
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
        if not rows:
            return
        with on_stream(self.stream):
            feed = self._feed_flat if len(rows) <= self.feed_rows else self._feed_grouped
            streams = feed(rows, positions, tokens, slots, groups, aux)
        for g, (request, blocks, first, n) in enumerate(groups):
            self.last[request.request_id] = _Last(request, blocks, positions[first + n - 1], streams[g])

    def _feed_flat(self, rows: list[int], positions: list[int], tokens: list[int], slots: list[int],
                   groups: list[tuple[Request, list[int], int, int]], aux: torch.Tensor) -> torch.Tensor:
        """A feed on the static buffers, one query row per position: -> each group's last output stream."""
        return self.steps.feed(self._feed_ints(rows, positions, tokens, slots, groups), len(rows), aux)

    def _feed_ints(self, rows: list[int], positions: list[int], tokens: list[int] | None, slots: list[int],
                   groups: list[tuple[Request, list[int], int, int]]) -> np.ndarray:
        """A feed's inputs in feed_layout order (tokens None: the feed takes them on the device, HeadSteps.feed)."""
        n, steps = len(rows), self.steps
        lay = feed_layout(bucket(n, steps.feed_buckets), steps.feed_width)
        ints = np.zeros(lay.size, dtype=np.int64)
        if tokens is not None:
            ints[lay.region(0)][:n] = tokens
        ints[lay.region(1)][:n] = positions
        ints[lay.region(2)] = -1  # padding rows write nothing (and read block 0's first position)
        ints[lay.region(2)][:n] = slots
        ints[lay.region(3)][:n] = rows
        ints[lay.region(4)][: len(groups)] = [first + count - 1 for _, _, first, count in groups]
        tables = ints[lay.tables].reshape(lay.rows, lay.width)
        for _, blocks, first, count in groups:
            tables[first : first + count, : len(blocks)] = blocks
        return ints

    def _feed_grouped(self, rows: list[int], positions: list[int], tokens: list[int], slots: list[int],
                      groups: list[tuple[Request, list[int], int, int]], aux: torch.Tensor) -> torch.Tensor:
        """A feed of many rows (prompt chunks) as it comes: each group's rows are the last queries of its
        sequence (the prefill attention). -> each group's last output stream."""
        device, head = self.kv.device, self.head
        width = max(len(blocks) for _, blocks, _, _ in groups)
        tables = np.zeros((len(groups), width), dtype=np.int64)
        ends = np.zeros(len(groups), dtype=np.int64)
        for g, (_, blocks, first, count) in enumerate(groups):
            tables[g, : len(blocks)] = blocks
            ends[g] = positions[first + count - 1] + 1
        counts = [count for *_, count in groups]
        starts = np.concatenate([[0], np.cumsum(counts)])
        meta = AttentionMetadata(slot_mapping=_ints(np.asarray(slots), device),
                                 query_start_loc=_ints(starts, device).to(torch.int32),
                                 seq_lens=_ints(ends, device).to(torch.int32),
                                 block_tables=_ints(tables, device).to(torch.int32), max_query_len=max(counts),
                                 max_seq_len=int(ends.max()))
        hidden = head.fuse(aux.index_select(0, _ints(np.asarray(rows), device)))
        out = head.layer_rows(_ints(np.asarray(tokens), device), hidden, _ints(np.asarray(positions), device),
                              self.kv, meta)
        return out.index_select(0, _ints(starts[1:] - 1, device))

    def _chosen(self, requests: list[tuple[Request, int]]) -> list[tuple[int, int, _Last]]:
        """(index, k, last row) of the requests the head can draft for: those whose last position it was fed."""
        chosen: list[tuple[int, int, _Last]] = []
        for i, (request, k) in enumerate(requests):
            last = self.last.get(request.request_id)
            if k > 0 and last is not None and last.position == len(request.all_token_ids) - 2:
                chosen.append((i, k, last))
        return chosen

    @torch.inference_mode()
    def propose_on_device(self, requests: list[tuple[Request, int]]) -> tuple[list[list[int]], torch.Tensor] | None:
        """propose_all without waiting for the device: the chain is enqueued and each request gets k stand-in ids
        naming its drafts in the chain's output (draft j of chain row b: draft_stand_in(b * max_drafts + j)),
        which the runner swaps for the drafts on the device before the verify forward (ModelExecutor.take_drafts).
        -> (stand-ins per request, the chain's output [rows, max_drafts] on the device); None where the requests
        take more than one chain (propose_all then)."""
        chosen = self._chosen(requests)
        if len(chosen) > self.chain_rows:
            return None
        drafts: list[list[int]] = [[] for _ in requests]
        if not chosen:
            return drafts, self.steps.chain_tokens[:0]
        width = self.steps.max_drafts
        ready = [self._ready.get(requests[i][0].request_id) for i, _, _ in chosen]
        if all(r is not None and r[1] == e.position for r, (_, _, e) in zip(ready, chosen)):
            # Drafted by the prefetched chain, behind the verify step the host just collected.
            for (i, k, _), r in zip(chosen, ready):
                assert r is not None
                drafts[i] = row_stand_ins(r[0], k, width)
            self._ready = {}
            return drafts, self.steps.chain_tokens
        tokens = self._chain([e for _, _, e in chosen])
        for b, (i, k, _) in enumerate(chosen):
            drafts[i] = row_stand_ins(b, k, width)
        return drafts, tokens

    @torch.inference_mode()
    def propose_all(self, requests: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to k greedy drafts for each (request, k): none for a request whose last position the head has not
        been fed (its hidden state there is unknown)."""
        chosen = self._chosen(requests)
        drafts: list[list[int]] = [[] for _ in requests]
        for lo in range(0, len(chosen), self.chain_rows):
            part = chosen[lo : lo + self.chain_rows]
            with on_stream(self.stream):  # the copy to the host after the chain, on its stream: the one wait here
                tokens = self._chain([e for _, _, e in part]).tolist()
            for (i, k, _), row in zip(part, tokens):
                drafts[i] = row[:k]
        return drafts

    def _chain(self, lasts: list[_Last]) -> torch.Tensor:
        """Enqueues the chain from each request's last row: -> [rows, max_drafts] target token ids on the device
        (the chain's static output, so a prefetched chain's drafts are gone)."""
        self._ready, self._prefetched = {}, []
        with on_stream(self.stream):
            return self.steps.chain(self._chain_ints(lasts), len(lasts), [e.stream for e in lasts])

    def _chain_ints(self, lasts: list[_Last]) -> np.ndarray:
        """A chain's inputs in chain_layout order. Chain row b owns scratch blocks: its table names the request's
        blocks of positions before the first chain position's block, then those (the first one a copy of that
        block)."""
        bs, steps, n = self.block_size, self.steps, len(lasts)
        lay = chain_layout(bucket(n, steps.chain_buckets), steps.chain_width)
        ints = np.zeros(lay.size, dtype=np.int64)
        positions, source, scratch = ints[lay.region(0)], ints[lay.region(1)], ints[lay.region(2)]
        tables = ints[lay.tables].reshape(lay.rows, lay.width)
        for b in range(lay.rows):
            own = self.first_scratch + b * self.scratch
            scratch[b] = source[b] = own
            full = 0  # padding rows chain from position 0 in their own scratch blocks
            if b < n:
                e = lasts[b]
                positions[b] = e.position + 1
                full = positions[b] // bs
                tables[b, :full] = e.blocks[:full]
                if positions[b] % bs:
                    source[b] = e.blocks[full]
            tables[b, full : full + self.scratch] = range(own, own + self.scratch)
        return ints
