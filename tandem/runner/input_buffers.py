"""Per-slot step buffers: pinned host staging written through numpy views, and static device twins.

Two slots (A/B) exist so that step N+1 is written and uploaded while step N still reads its own
slot on the GPU. Nothing here allocates per step: the runner writes numpy views in place and issues
one non_blocking copy per packed buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.request import Request
from tandem.scheduler.output import ScheduledRequest, SchedulerOutput


class PackedBuffer:
    """Named regions of one host tensor (pinned on CUDA) and of its device twin (the same tensor on CPU)."""

    def __init__(self, fields: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> None:
        sizes = {name: int(np.prod(shape)) for name, shape in fields.items()}
        total = sum(sizes.values())
        cuda = device.type == "cuda"
        self.cpu = torch.zeros(total, dtype=dtype, pin_memory=cuda)
        self.gpu = torch.zeros(total, dtype=dtype, device=device) if cuda else self.cpu
        self.np: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, int] = {}
        host_np = self.cpu.numpy()
        offset = 0
        for name, shape in fields.items():
            size = sizes[name]
            self.offsets[name] = offset
            self.np[name] = host_np[offset : offset + size].reshape(shape)
            self.dev[name] = self.gpu[offset : offset + size].view(shape)
            offset += size
        self.total = total

    def upload(self, num_elements: int | None = None) -> None:
        """Copies the first num_elements host elements to the device (call on the H2D stream)."""
        if self.gpu is self.cpu:
            return
        n = self.total if num_elements is None else num_elements
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class StepBuffers:
    """Inputs and outputs of one slot."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_logprobs: int,
        device: torch.device,
        max_drafts: int = 0,
        lora: bool = False,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        # Logits rows: one per sequence (row i: sequence i's last position), then, in a step that verifies drafts,
        # one per draft (the position before it, whose sampled token the draft is checked against).
        self.max_rows = max_rows = max_num_seqs * (1 + max_drafts)
        # Block tables come last so that a step uploads only the rows it uses.
        self.ints = PackedBuffer(
            {
                "input_ids": (max_num_tokens,),
                "positions": (max_num_tokens,),
                # Per attention row: a sequence, or in a flat verify step (write_flat_verify) a token.
                "query_start_loc": (max_rows + 1,),
                "seq_lens": (max_rows,),
                "logits_indices": (max_rows,),
                "top_k": (max_rows,),
                # The decode kernel's program order: decode rows by context length, longest first.
                "decode_order": (max_rows,),
                # Draft rows (rows >= num_seqs of a verify step): their sequence, their draft's index in it, the
                # draft token their sample is compared with; and each sequence's number of drafts.
                "row_seq": (max_rows,),
                "row_rank": (max_rows,),
                "row_draft": (max_rows,),
                "num_drafts": (max_rows,),
                # A flat verify step scheduled behind a verify step in flight (EngineCore._verify_ahead): per row,
                # its request's sequence in that step (-1: none), that sequence's drafts and first draft row there,
                # from which the device finds how far back the row's positions move (ModelExecutor.shift_rows).
                **({"shift_seq": (max_rows,), "shift_k": (max_rows,), "shift_base": (max_rows,)} if max_drafts
                   else {}),
                # With LoRA adapters: each token's adapter slot in the device pool (-1: none), tandem.lora.
                **({"lora_slots": (max_num_tokens,)} if lora else {}),
                "block_tables": (max_rows, max_blocks_per_seq),
            },
            torch.int32,
            device,
        )
        self.longs = PackedBuffer(
            {
                "slot_mapping": (max_num_tokens,),
                "carry_src": (max_num_tokens,),  # -1: no carry-over; else a row of the previous step's tokens
                "seeds": (max_rows,),
                "sample_pos": (max_rows,),
            },
            torch.int64,
            device,
        )
        self.floats = PackedBuffer(
            {"temperature": (max_rows,), "top_p": (max_rows,), "min_p": (max_rows,)}, torch.float32, device
        )
        # Outputs: static device tensors (the next step's carry-over reads out_tokens) and pinned host twins.
        cuda = device.type == "cuda"
        self.out_tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.out_logprob = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.out_top_ids = torch.zeros(max_rows, max(max_logprobs, 1), dtype=torch.int64, device=device)
        self.out_top_lp = torch.zeros(max_rows, max(max_logprobs, 1), dtype=torch.float32, device=device)
        self.out_accepted = torch.zeros(max_rows, dtype=torch.int64, device=device)  # drafts accepted per seq
        # Per row of a step shifted behind a verify step: how far its positions moved back (drafts rejected there).
        self.row_shift = torch.zeros(max_rows, dtype=torch.int64, device=device)
        if cuda:
            self.host_tokens = torch.zeros_like(self.out_tokens, device="cpu").pin_memory()
            self.host_logprob = torch.zeros_like(self.out_logprob, device="cpu").pin_memory()
            self.host_top_ids = torch.zeros_like(self.out_top_ids, device="cpu").pin_memory()
            self.host_top_lp = torch.zeros_like(self.out_top_lp, device="cpu").pin_memory()
            self.host_accepted = torch.zeros_like(self.out_accepted, device="cpu").pin_memory()
        else:
            self.host_tokens, self.host_logprob = self.out_tokens, self.out_logprob
            self.host_top_ids, self.host_top_lp = self.out_top_ids, self.out_top_lp
            self.host_accepted = self.out_accepted
        # Block-table rows persist between this slot's steps: row i holds the first table_lens[i] entries of
        # the block list table_rows[i] (compared by identity: a request's list only grows while it holds
        # blocks, and a preempted request gets a new one), so a decode step rewrites only rows that changed.
        self.table_rows: list[list[int] | None] = [None] * max_rows
        self.table_lens: list[int] = [0] * max_rows
        # The requests whose sampling parameters rows 0..n-1 hold (identity), and what write_step derived
        # from them: (all greedy, any top-k/top-p row, most logprobs asked or -1).
        self.sampling_rows: list[Request] | None = None
        self.sampling_state: tuple[bool, bool, int, bool] = (True, False, -1, False)
        self.host_tokens_np = self.host_tokens.numpy()
        self.host_logprob_np = self.host_logprob.numpy()
        self.host_top_ids_np = self.host_top_ids.numpy()
        self.host_top_lp_np = self.host_top_lp.numpy()
        self.host_accepted_np = self.host_accepted.numpy()

    def upload(self, num_seqs: int) -> None:
        """H2D of everything the step reads: the packed scalars and the used block-table rows."""
        used_ints = self.ints.offsets["block_tables"] + num_seqs * self.max_blocks_per_seq
        self.ints.upload(used_ints)
        self.longs.upload()
        self.floats.upload()

    def download(self, num_seqs: int, num_logprobs: int, num_rows: int | None = None) -> None:
        """D2H of the sampled tokens (and log-probabilities when asked) of the step's num_rows logits rows (default
        one per sequence; more in a verify step, which also brings each sequence's accepted count); call on the
        D2H stream."""
        if self.host_tokens is self.out_tokens:
            return
        rows = num_seqs if num_rows is None else num_rows
        self.host_tokens[:rows].copy_(self.out_tokens[:rows], non_blocking=True)
        if rows > num_seqs:
            self.host_accepted[:num_seqs].copy_(self.out_accepted[:num_seqs], non_blocking=True)
        if num_logprobs >= 0:
            self.host_logprob[:rows].copy_(self.out_logprob[:rows], non_blocking=True)
        if num_logprobs > 0:
            self.host_top_ids[:rows].copy_(self.out_top_ids[:rows], non_blocking=True)
            self.host_top_lp[:rows].copy_(self.out_top_lp[:rows], non_blocking=True)


@dataclass(slots=True)
class StepShape:
    """What `write_step` learns about a step while writing it, for the launch."""

    all_greedy: bool
    any_top_k_top_p: bool
    num_logprobs: int  # -1: no row asked for log-probabilities
    max_query_len: int
    max_seq_len: int
    num_context_tokens: int
    num_decodes: int = 0  # leading rows that decode one token (AttentionMetadata.num_decodes)
    any_logits_state: bool = False  # some row uses penalties / bias / allowed ids / bad words (LogitsState)
    num_rows: int = 0  # logits rows: num_seqs, plus one per draft in a verify step
    # Verify steps: (row, first draft row, number of drafts) of each sequence with drafts.
    draft_rows: list[tuple[int, int, int]] | None = None
    shifted: bool = False  # some row's positions wait for the accepted count of the verify step in flight


def write_step(buf: StepBuffers, sched: SchedulerOutput, prev_rows: dict[str, int], block_size: int,
               pad_to: int | None, rows: dict[str, int], pad_tokens_to: int | None = None) -> StepShape:
    """Writes a scheduled step into the slot's pinned host buffers; fills `rows` (request id -> row).

    `pad_to` pads a decode step's rows to a captured batch size; `pad_tokens_to` pads only the token rows
    (ids, positions, slot mapping, carry sources) to a piecewise graph's token bucket.

    One Python pass gathers per-row values into lists, then each field gets one numpy assignment: a
    numpy scalar store costs about as much as a whole list append, and a decode step at batch 256 would
    otherwise spend milliseconds in them. `prev_rows` maps request ids to rows of the previous step's
    sampled tokens (the carry-over sources). The sampling rows are rewritten only when the slot's last
    step held other requests (or another order): in steady decode the batch repeats step after step.
    """
    ints, longs = buf.ints.np, buf.longs.np
    input_ids, positions, slot_mapping = ints["input_ids"], ints["positions"], longs["slot_mapping"]
    block_tables, table_rows, table_lens = ints["block_tables"], buf.table_rows, buf.table_lens
    bs = block_size
    scheduled = sched.scheduled
    num_seqs = len(scheduled)
    num_tokens = sched.num_scheduled_tokens
    decode_only = num_tokens == num_seqs
    carry_src = longs["carry_src"]
    one_pos: list[int] = []
    one_slot: list[int] = []
    carry_rows: list[int] = []
    used: list[int] = []  # block-table entries each row's attention reads
    t = 0
    if decode_only:
        # The steady state: every row decodes one token, rows 0..n-1 in order. One pass gathers the positions,
        # slots, carry sources (-1: the token is known) and table lengths; each field then gets one store.
        for i, s in enumerate(scheduled):
            start = s.num_computed_tokens
            blocks = s.block_ids
            one_pos.append(start)
            one_slot.append(blocks[start // bs] * bs + start % bs)
            rid = s.request.request_id
            carry_rows.append(prev_rows[rid] if s.carry else -1)
            used.append(start // bs + 1)
            rows[rid] = i
        t = num_tokens
        input_ids[:t] = [s.token_ids[0] for s in scheduled]
        positions[:t] = one_pos
        slot_mapping[:t] = one_slot
        carry_src[:t] = carry_rows
    else:
        # Rows of one-token requests, written together at the end by fancy indexing.
        one_t: list[int] = []
        one_ids: list[int] = []
        carry_t: list[int] = []
        query_lens: list[int] = []
        ends: list[int] = []
        for i, s in enumerate(scheduled):
            n, start = s.num_scheduled_tokens, s.num_computed_tokens
            end = start + n
            blocks = s.block_ids
            if n == 1:
                one_t.append(t)
                one_ids.append(s.token_ids[0])
                one_pos.append(start)
                one_slot.append(blocks[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, end)
                input_ids[t : t + n] = s.token_ids
                positions[t : t + n] = pos
                slot_mapping[t : t + n] = np.asarray(blocks)[pos // bs] * bs + pos % bs
            t += n
            rid = s.request.request_id
            if s.carry:
                carry_t.append(t - 1)
                carry_rows.append(prev_rows[rid])
            used.append((end + bs - 1) // bs)
            query_lens.append(n)
            ends.append(end)
            rows[rid] = i
        if one_t:
            input_ids[one_t] = one_ids
            positions[one_t] = one_pos
            slot_mapping[one_t] = one_slot
        carry_src[:num_tokens] = -1
        if carry_t:
            carry_src[carry_t] = carry_rows
    # Block-table rows: only what changed since the slot's last step is rewritten.
    for i, (s, num_used) in enumerate(zip(scheduled, used)):
        blocks = s.block_ids
        if table_rows[i] is blocks:
            done = table_lens[i]
            if done < num_used:
                block_tables[i, done:num_used] = blocks[done:num_used]
                table_lens[i] = num_used
        else:
            block_tables[i, :num_used] = blocks[:num_used]
            table_rows[i], table_lens[i] = blocks, num_used
    seq_lens, qsl, sample_pos = ints["seq_lens"], ints["query_start_loc"], longs["sample_pos"]
    qsl[0] = 0
    if decode_only:
        np.add(positions[:num_seqs], 1, out=seq_lens[:num_seqs])
        qsl[1 : num_seqs + 1] = np.arange(1, num_seqs + 1)
        max_query_len = 1 if num_seqs else 0
        num_decodes = num_seqs
    else:
        seq_lens[:num_seqs] = ends
        np.cumsum(query_lens, out=qsl[1 : num_seqs + 1])
        max_query_len = max(query_lens, default=0)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), num_seqs)
    sample_pos[:num_seqs] = seq_lens[:num_seqs]
    ints["logits_indices"][:num_seqs] = qsl[1 : num_seqs + 1] - 1
    all_greedy, any_filter, num_logprobs, any_logits_state = _sampling_rows(buf, scheduled)
    if pad_tokens_to is not None and pad_tokens_to > t:
        # Padding tokens of a piecewise graph: no KV write and no carry; the attention between the pieces
        # covers only the step's sequences, and no logits row reads them.
        input_ids[t:pad_tokens_to] = 0
        positions[t:pad_tokens_to] = 0
        slot_mapping[t:pad_tokens_to] = -1
        carry_src[t:pad_tokens_to] = -1
    if pad_to is not None and pad_to > num_seqs:
        _write_padding(buf, t, num_seqs, pad_to)
    # The decode kernel starts its programs longest context first (load balance over its waves): every row it
    # runs, padding rows included, or a mixed step's leading one-token rows. A stable sort: ties keep row order.
    order_rows = max(num_seqs, pad_to or 0) if decode_only else num_decodes
    if order_rows:
        ints["decode_order"][:order_rows] = np.argsort(-seq_lens[:order_rows], kind="stable")
    num_rows, draft_rows = num_seqs, None
    if sched.num_draft_tokens:
        num_rows, draft_rows = _write_draft_rows(buf, sched)
    seq_used = seq_lens[:num_seqs]
    return StepShape(all_greedy, any_filter, num_logprobs, max_query_len, int(seq_used.max()) if num_seqs else 0,
                     int(seq_used.sum(dtype=np.int64)), num_decodes, any_logits_state, num_rows, draft_rows)


def _write_draft_rows(buf: StepBuffers, sched: SchedulerOutput) -> tuple[int, list[tuple[int, int, int]]]:
    """Logits rows num_seqs.. of a verify step: for each draft j of sequence i, the position before it (its sample
    is the target's token there, compared with draft j on the device). Returns (rows, draft_rows)."""
    ints, longs = buf.ints.np, buf.longs.np
    num_seqs = len(sched.scheduled)
    qsl = ints["query_start_loc"]
    row = num_seqs
    index: list[int] = []
    positions: list[int] = []
    seqs: list[int] = []
    ranks: list[int] = []
    drafts: list[int] = []
    counts = [0] * num_seqs
    draft_rows: list[tuple[int, int, int]] = []
    for i, s in enumerate(sched.scheduled):
        k = s.num_draft
        if not k:
            continue
        first = int(qsl[i + 1]) - k - 1  # the flat token index of the sequence's known last token
        index.extend(range(first, first + k))
        start = s.num_computed_tokens + s.num_scheduled_tokens - k  # the position of the first draft
        positions.extend(range(start, start + k))
        seqs.extend([i] * k)
        ranks.extend(range(k))
        drafts.extend(s.token_ids[-k:])
        counts[i] = k
        draft_rows.append((i, row, k))
        row += k
    ints["logits_indices"][num_seqs:row] = index
    longs["sample_pos"][num_seqs:row] = positions
    _write_verify_rows(buf, num_seqs, row, seqs, ranks, drafts, counts, row)
    return row, draft_rows


def _write_verify_rows(buf: StepBuffers, num_seqs: int, num_rows: int, seqs: list[int], ranks: list[int],
                       drafts: list[int], counts: list[int], pad_to: int) -> None:
    """What ModelExecutor.verify reads for rows 0..pad_to-1: draft rows (num_seqs..num_rows-1) name their sequence,
    their draft's index and the draft; every other row (a sequence's own, or padding) names itself, with an index
    past any draft count and no draft, so it changes no count. Draft rows also get their sequence's sampling
    parameters, so that the sampler (and a verify graph) reads per-row parameters for every row."""
    ints, longs, floats = buf.ints.np, buf.longs.np, buf.floats.np
    if num_rows > num_seqs:
        idx = np.asarray(seqs)
        for region in (floats["temperature"], floats["top_p"], floats["min_p"], ints["top_k"], longs["seeds"]):
            region[num_seqs:num_rows] = region[idx]
        buf.sampling_rows = None  # rows past num_seqs now hold draft rows: a later step rewrites its own
    never = buf.max_rows  # > any draft count
    ints["row_seq"][:num_seqs] = np.arange(num_seqs)
    ints["row_rank"][:num_seqs] = never
    ints["row_draft"][:num_seqs] = -1
    ints["row_seq"][num_seqs:num_rows] = seqs
    ints["row_rank"][num_seqs:num_rows] = ranks
    ints["row_draft"][num_seqs:num_rows] = drafts
    ints["num_drafts"][:num_seqs] = counts
    if pad_to > num_rows:
        ints["row_seq"][num_rows:pad_to] = np.arange(num_rows, pad_to)
        ints["row_rank"][num_rows:pad_to] = never
        ints["row_draft"][num_rows:pad_to] = -1
    ints["num_drafts"][num_seqs:pad_to] = 0


def _sampling_rows(buf: StepBuffers, scheduled: list[ScheduledRequest]) -> tuple[bool, bool, int, bool]:
    """Rows 0..n-1's sampling parameters, rewritten only when the slot's last step held other requests (or another
    order): in steady decode the batch repeats step after step. Returns _write_sampling's summary."""
    requests = [s.request for s in scheduled]
    if buf.sampling_rows is None or requests != buf.sampling_rows:  # == compares identities first
        buf.sampling_state = _write_sampling(buf, requests)
    buf.sampling_rows = requests
    return buf.sampling_state


def _write_sampling(buf: StepBuffers, requests: list[Request]) -> tuple[bool, bool, int, bool]:
    """Writes the rows' sampling parameters; returns (all greedy, any top-k/top-p/min-p row, most logprobs or -1,
    any row with logits state)."""
    n = len(requests)
    params = [r.sampling_params for r in requests]
    temperature = [sp.temperature for sp in params]
    buf.floats.np["temperature"][:n] = temperature
    buf.floats.np["top_p"][:n] = [sp.top_p for sp in params]
    buf.floats.np["min_p"][:n] = [sp.min_p for sp in params]
    buf.ints.np["top_k"][:n] = [sp.top_k for sp in params]
    buf.longs.np["seeds"][:n] = [r.sampling_seed for r in requests]
    any_filter = any(sp.temperature != 0.0 and (sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0) for sp in params)
    num_logprobs = max((sp.logprobs for sp in params if sp.logprobs is not None), default=-1)
    any_state = any(sp.uses_logits_state for sp in params)
    return not any(temperature), any_filter, num_logprobs, any_state


def write_flat_verify(buf: StepBuffers, sched: SchedulerOutput, prev_rows: dict[str, int], block_size: int,
                      pad_to: int | None, rows: dict[str, int],
                      prev_drafts: dict[str, tuple[int, int]] | None = None) -> StepShape:
    """Writes a step in which every sequence decodes one token or verifies drafts as a decode step of one
    attention row per token, so that it runs as a decode graph: each token attends to its own context (the paged
    KV of its sequence up to its position; every layer writes the step's KV before its attention reads any).

    Row i (< num_seqs) is sequence i's last position, as in every step; rows num_seqs.. are its draft positions,
    one per draft (the position before the draft, whose sampled token the draft is checked against), with their
    sequence's sampling parameters written beside them. Logits rows are the attention rows.

    A sequence whose first token is carried from a flat verify step in flight (`prev_drafts`: request id -> its
    drafts and first draft row there) was scheduled as if that step kept every draft: its rows name that step's
    sequence (shift_seq, shift_k, shift_base), and the device moves their positions back by the drafts it rejected
    and carries the token it sampled after the accepted ones (ModelExecutor.shift_rows).
    """
    ints, longs = buf.ints.np, buf.longs.np
    bs = block_size
    scheduled = sched.scheduled
    num_seqs = len(scheduled)
    all_greedy, any_filter, num_logprobs, any_logits_state = _sampling_rows(buf, scheduled)
    ids: list[int] = []
    pos: list[int] = []
    carry: list[int] = []
    tables: list[list[int]] = []
    extra_ids: list[int] = []
    extra_pos: list[int] = []
    extra_tables: list[list[int]] = []
    seqs: list[int] = []
    ranks: list[int] = []
    drafts: list[int] = []
    counts = [0] * num_seqs
    draft_rows: list[tuple[int, int, int]] = []
    extra_carry: list[int] = []
    # Per row (own rows, then draft rows): (sequence, drafts, first draft row) in the verify step in flight.
    shift: list[tuple[int, int, int]] = []
    extra_shift: list[tuple[int, int, int]] = []
    none = (-1, 0, 0)
    row = num_seqs
    for i, s in enumerate(scheduled):
        k, start, blocks = s.num_draft, s.num_computed_tokens, s.block_ids
        rid = s.request.request_id
        ids.append(s.token_ids[-1])
        pos.append(start + k)
        src = prev_rows[rid] if s.carry else -1
        # The carried token is the first input: the own row's without drafts, else the first draft row's.
        carry.append(-1 if k else src)
        behind = prev_drafts.get(rid) if (prev_drafts is not None and s.carry) else None
        moved = none if behind is None else (src, *behind)
        shift.append(moved)
        tables.append(blocks)
        rows[rid] = i
        if k:
            extra_ids.extend(s.token_ids[:k])
            extra_pos.extend(range(start, start + k))
            extra_tables.extend([blocks] * k)
            extra_carry.append(src)
            extra_carry.extend([-1] * (k - 1))
            extra_shift.extend([moved] * k)
            seqs.extend([i] * k)
            ranks.extend(range(k))
            drafts.extend(s.token_ids[1:])
            counts[i] = k
            draft_rows.append((i, row, k))
            row += k
    num_rows = row
    all_pos = pos + extra_pos
    ints["input_ids"][:num_rows] = ids + extra_ids
    ints["positions"][:num_rows] = all_pos
    positions = ints["positions"][:num_rows].astype(np.int64)
    table_of = tables + extra_tables
    longs["slot_mapping"][:num_rows] = [t[p // bs] * bs + p % bs for t, p in zip(table_of, all_pos)]
    longs["carry_src"][:num_rows] = carry + extra_carry
    shifted = False
    if "shift_seq" in ints:
        width = max(num_rows, pad_to or 0)
        ints["shift_seq"][:width] = -1
        all_shift = shift + extra_shift
        shifted = any(seq >= 0 for seq, _, _ in all_shift)
        if shifted:
            ints["shift_seq"][:num_rows], ints["shift_k"][:num_rows], ints["shift_base"][:num_rows] = zip(*all_shift)
    block_tables, table_rows, table_lens = ints["block_tables"], buf.table_rows, buf.table_lens
    for r, (blocks, p) in enumerate(zip(table_of, all_pos)):
        num_used = p // bs + 1
        if table_rows[r] is blocks and table_lens[r] >= num_used:
            continue
        block_tables[r, :num_used] = blocks[:num_used]
        table_rows[r], table_lens[r] = blocks, num_used
    seq_lens, qsl = ints["seq_lens"], ints["query_start_loc"]
    np.add(positions, 1, out=seq_lens[:num_rows])
    qsl[: num_rows + 1] = np.arange(num_rows + 1)
    longs["sample_pos"][:num_rows] = seq_lens[:num_rows]
    ints["logits_indices"][:num_rows] = np.arange(num_rows)
    _write_verify_rows(buf, num_seqs, num_rows, seqs, ranks, drafts, counts, max(num_rows, pad_to or 0))
    if pad_to is not None and pad_to > num_rows:
        _write_padding(buf, num_rows, num_rows, pad_to)
    order_rows = max(num_rows, pad_to or 0)
    ints["decode_order"][:order_rows] = np.argsort(-seq_lens[:order_rows], kind="stable")
    seq_used = seq_lens[:num_rows]
    context = int(seq_lens[:num_seqs].sum(dtype=np.int64))
    return StepShape(all_greedy, any_filter, num_logprobs, 1, int(seq_used.max()), context, num_rows,
                     any_logits_state, num_rows, draft_rows, shifted)


def _write_padding(buf: StepBuffers, num_tokens: int, num_seqs: int, pad_to: int) -> None:
    """Padding rows of a captured decode graph: no KV write, empty context, no carry; sampled inside the graph
    too, so they get valid greedy parameters whatever the slot held before."""
    ints, longs, floats = buf.ints.np, buf.longs.np, buf.floats.np
    t = num_tokens
    ints["input_ids"][t:pad_to] = 0
    ints["positions"][t:pad_to] = 0
    longs["slot_mapping"][t:pad_to] = -1
    longs["carry_src"][t:pad_to] = -1
    ints["query_start_loc"][num_seqs + 1 : pad_to + 1] = np.arange(t + 1, pad_to + 1)
    ints["seq_lens"][num_seqs:pad_to] = 0
    floats["temperature"][num_seqs:pad_to] = 0.0
    floats["top_p"][num_seqs:pad_to] = 1.0
    floats["min_p"][num_seqs:pad_to] = 0.0
    ints["top_k"][num_seqs:pad_to] = 0
    longs["seeds"][num_seqs:pad_to] = 0
    longs["sample_pos"][num_seqs:pad_to] = 0
