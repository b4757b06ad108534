"""EAGLE-3 proposer: feeds the head every collected step's hidden states (its one layer's KV lives in a cache of its
own under the target's block ids) and drafts a request's next tokens by chaining the head on its own output."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tandem.request import Request, RequestStatus
from tandem.scheduler.output import SchedulerOutput, ScheduledRequest
from tandem.speculative.eagle3_head import Eagle3Head

_FAR = 1 << 30  # position of padding context entries: no query reaches them
QUERY_CHUNK = 256  # query rows per attention call


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


def _ints(values: list[int] | list[list[int]] | np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 values on the device without waiting for the device: torch.tensor(..., device=cuda) copies
    synchronously, and would wait for the step in flight on the stream."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    # From pinned memory (PyTorch caches those blocks): a pageable source may make the copy wait for the stream.
    return host.pin_memory().to(device, non_blocking=True)


def _attention(head: Eagle3Head, q: torch.Tensor, q_pos: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor],
               k_ctx: torch.Tensor, v_ctx: torch.Tensor, ctx_pos: torch.Tensor) -> torch.Tensor:
    """Causal attention of rows q [n, heads, dim] (row j at (batch, index) where[0][j], where[1][j]; q_pos [B, Q]
    each padded query's position, 0 for padding) over their sequence's context k_ctx, v_ctx [B, L, kv heads, dim]
    at positions ctx_pos [B, L]: a query sees the entries at positions <= its own. -> [n, heads x dim]."""
    c = head.config
    batch, num_q = q_pos.shape
    padded = q.new_zeros(batch, num_q, c.num_heads, c.head_dim)
    padded[where] = q
    mask = ctx_pos[:, None, :] <= q_pos[:, :, None]  # [B, Q, L]; every query sees position 0 (no empty row)
    k, v = k_ctx.transpose(1, 2), v_ctx.transpose(1, 2)  # [B, kv heads, L, dim]
    # Queries a chunk at a time: where no fused kernel takes the mask, the scores [B, heads, chunk, L] are
    # materialized, which a long prompt's rows at once would not fit.
    outs = [F.scaled_dot_product_attention(padded[:, lo : lo + QUERY_CHUNK].transpose(1, 2), k, v,
                                           attn_mask=mask[:, None, lo : lo + QUERY_CHUNK], scale=c.head_dim**-0.5,
                                           enable_gqa=c.num_heads != c.num_kv_heads)
            for lo in range(0, num_q, QUERY_CHUNK)]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # [B, heads, Q, dim]
    return out.transpose(1, 2)[where].reshape(q.shape[0], c.num_heads * c.head_dim)


class Eagle3Proposer:
    """Greedy chain drafts from an EAGLE-3 head. `observe` runs the head over the rows a collected target step
    computed whose next token is known (prompt chunks, decodes, a verify step's accepted positions), writing its
    KV at their positions; `propose_all` chains it k times from each request's last row."""

    def __init__(self, head: Eagle3Head, num_blocks: int, block_size: int, stream: torch.cuda.Stream | None) -> None:
        c = head.config
        self.head, self.block_size, self.stream = head, block_size, stream
        device, dtype = head.fc.device, head.fc.dtype
        # [K / V, slot = block * block_size + offset, kv heads, dim]: the target's block ids index it too, so a
        # position's head KV lives wherever the target keeps that position's KV (and prefix-cache hits find it).
        self.kv = torch.zeros(2, num_blocks * block_size, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        self.last: dict[str, _Last] = {}

    def release(self) -> None:
        """Drops the head's weights, KV cache and kept rows, so that their memory can go back to the device (the
        engine is shut down: nothing is fed or proposed afterwards)."""
        self.head.release()
        self.kv = torch.empty(0, device=self.kv.device)
        self.last = {}

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _context(self, tables: list[tuple[list[int], int]], extra: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head KV of positions 0 .. end - 1 of each (block table, end), then `extra` free columns (for the chain's
        own rows): k, v [B, L + extra, kv heads, dim] and positions [B, L + extra] (padding and free: far)."""
        bs = self.block_size
        width = max(end for _, end in tables)
        slots = np.zeros((len(tables), width + extra), dtype=np.int64)
        positions = np.full((len(tables), width + extra), _FAR, dtype=np.int64)
        for b, (blocks, end) in enumerate(tables):
            pos = np.arange(end)
            slots[b, :end] = np.asarray(blocks[: (end + bs - 1) // bs], dtype=np.int64)[pos // bs] * bs + pos % bs
            positions[b, :end] = pos
        device = self.kv.device
        index = _ints(slots, device)
        return self.kv[0][index], self.kv[1][index], _ints(positions, device)

    @torch.inference_mode()
    def observe(self, sched: SchedulerOutput, flat: bool, aux: torch.Tensor) -> None:
        """Feeds the head a collected step's rows: aux [>= step rows, 3 x target hidden] (the slot's copy)."""
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
            blocks = s.block_ids
            groups.append((request, blocks, len(rows), end - start))
            rows.extend(step_rows_[: end - start])
            positions.extend(range(start, end))
            tokens.extend(known[start + 1 : end + 1])
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
        live = {rid: e for rid, e in self.last.items() if e.request.status is RequestStatus.RUNNING}
        self.last = live
        if not rows:
            return
        with self._on_stream():
            self._feed(rows, positions, tokens, slots, groups, aux)

    def _feed(self, rows: list[int], positions: list[int], tokens: list[int], slots: list[int],
              groups: list[tuple[Request, list[int], int, int]], aux: torch.Tensor) -> None:
        head, device = self.head, self.kv.device
        hidden = head.fuse(aux.index_select(0, _ints(rows, device)))
        pos = _ints(positions, device)
        q, k, v, residual = head.qkv_rows(_ints(tokens, device), hidden, pos)
        slot_index = _ints(slots, device)
        self.kv[0].index_copy_(0, slot_index, k)
        self.kv[1].index_copy_(0, slot_index, v)
        k_ctx, v_ctx, ctx_pos = self._context([(blocks, positions[first + n - 1] + 1)
                                               for _, blocks, first, n in groups])
        num_q = max(n for *_, n in groups)
        q_pos = [[0] * num_q for _ in groups]
        batch_idx: list[int] = []
        query_idx: list[int] = []
        for b, (_, _, first, n) in enumerate(groups):
            q_pos[b][:n] = positions[first : first + n]
            batch_idx.extend([b] * n)
            query_idx.extend(range(n))
        where = (_ints(batch_idx, device), _ints(query_idx, device))
        out = _attention(head, q, _ints(q_pos, device), where, k_ctx, v_ctx, ctx_pos)
        stream = head.finish_rows(out, residual)
        for request, blocks, first, n in groups:
            row = first + n - 1
            self.last[request.request_id] = _Last(request, blocks, positions[row], stream[row].clone())

    @torch.inference_mode()
    def propose_all(self, requests: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to k greedy drafts for each (request, k): none for a request whose last position the head has not
        been fed (its hidden state there is unknown)."""
        chosen: list[tuple[int, Request, int, _Last]] = []
        for i, (request, k) in enumerate(requests):
            last = self.last.get(request.request_id)
            if k > 0 and last is not None and last.position == len(request.all_token_ids) - 2:
                chosen.append((i, request, k, last))
        drafts: list[list[int]] = [[] for _ in requests]
        if not chosen:
            return drafts
        with self._on_stream():
            tokens = self._chain([(r, e) for _, r, _, e in chosen], max(k for _, _, k, _ in chosen))
        for (i, _, k, _), row in zip(chosen, tokens):
            drafts[i] = row[:k]
        return drafts

    def _chain(self, chosen: list[tuple[Request, _Last]], num: int) -> list[list[int]]:
        """num chain steps for each request: [B][num] target token ids (the only wait for the device here)."""
        head, device = self.head, self.kv.device
        long = dict(dtype=torch.int64, device=device)
        width = max(e.position + 1 for _, e in chosen)
        k_ctx, v_ctx, ctx_pos = self._context([(e.blocks, e.position + 1) for _, e in chosen], extra=num - 1)
        stream = torch.stack([e.stream for _, e in chosen])  # [B, hidden]
        token = head.draft(stream)
        out = [token]
        pos = _ints([e.position + 1 for _, e in chosen], device)  # the row after the last fed one
        where = (torch.arange(len(chosen), **long), torch.zeros(len(chosen), **long))
        for j in range(num - 1):
            q, k, v, residual = head.qkv_rows(token, stream, pos)
            # The chain's own KV stays here, in the free columns: its positions may lie past the blocks the
            # target holds yet.
            k_ctx[:, width + j], v_ctx[:, width + j], ctx_pos[:, width + j] = k, v, pos
            stream = head.finish_rows(_attention(head, q, pos[:, None], where, k_ctx, v_ctx, ctx_pos), residual)
            token = head.draft(stream)
            out.append(token)
            pos = pos + 1
        return torch.stack(out, dim=1).tolist()
