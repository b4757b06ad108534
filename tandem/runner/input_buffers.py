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
from tandem.scheduler.output import SchedulerOutput


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
        lora: bool = False,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        # Block tables come last so that a step uploads only the rows it uses.
        self.ints = PackedBuffer(
            {
                "input_ids": (max_num_tokens,),
                "positions": (max_num_tokens,),
                "query_start_loc": (max_num_seqs + 1,),
                "seq_lens": (max_num_seqs,),
                "logits_indices": (max_num_seqs,),
                "top_k": (max_num_seqs,),
                # The decode kernel's program order: decode rows by context length, longest first.
                "decode_order": (max_num_seqs,),
                # With LoRA adapters: each token's adapter slot in the device pool (-1: none), tandem.lora.
                **({"lora_slots": (max_num_tokens,)} if lora else {}),
                "block_tables": (max_num_seqs, max_blocks_per_seq),
            },
            torch.int32,
            device,
        )
        self.longs = PackedBuffer(
            {
                "slot_mapping": (max_num_tokens,),
                "carry_src": (max_num_tokens,),  # -1: no carry-over; else a row of the previous step's tokens
                "seeds": (max_num_seqs,),
                "sample_pos": (max_num_seqs,),
            },
            torch.int64,
            device,
        )
        self.floats = PackedBuffer(
            {"temperature": (max_num_seqs,), "top_p": (max_num_seqs,), "min_p": (max_num_seqs,)}, torch.float32, device
        )
        # Outputs: static device tensors (the next step's carry-over reads out_tokens) and pinned host twins.
        cuda = device.type == "cuda"
        self.out_tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.out_logprob = torch.zeros(max_num_seqs, dtype=torch.float32, device=device)
        self.out_top_ids = torch.zeros(max_num_seqs, max(max_logprobs, 1), dtype=torch.int64, device=device)
        self.out_top_lp = torch.zeros(max_num_seqs, max(max_logprobs, 1), dtype=torch.float32, device=device)
        if cuda:
            self.host_tokens = torch.zeros_like(self.out_tokens, device="cpu").pin_memory()
            self.host_logprob = torch.zeros_like(self.out_logprob, device="cpu").pin_memory()
            self.host_top_ids = torch.zeros_like(self.out_top_ids, device="cpu").pin_memory()
            self.host_top_lp = torch.zeros_like(self.out_top_lp, device="cpu").pin_memory()
        else:
            self.host_tokens, self.host_logprob = self.out_tokens, self.out_logprob
            self.host_top_ids, self.host_top_lp = self.out_top_ids, self.out_top_lp
        # Block-table rows persist between this slot's steps: row i holds the first table_lens[i] entries of
        # the block list table_rows[i] (compared by identity: a request's list only grows while it holds
        # blocks, and a preempted request gets a new one), so a decode step rewrites only rows that changed.
        self.table_rows: list[list[int] | None] = [None] * max_num_seqs
        self.table_lens: list[int] = [0] * max_num_seqs
        # The requests whose sampling parameters rows 0..n-1 hold (identity), and what write_step derived
        # from them: (all greedy, any top-k/top-p row, most logprobs asked or -1).
        self.sampling_rows: list[Request] | None = None
        self.sampling_state: tuple[bool, bool, int, bool] = (True, False, -1, False)
        self.host_tokens_np = self.host_tokens.numpy()
        self.host_logprob_np = self.host_logprob.numpy()
        self.host_top_ids_np = self.host_top_ids.numpy()
        self.host_top_lp_np = self.host_top_lp.numpy()

    def upload(self, num_seqs: int) -> None:
        """H2D of everything the step reads: the packed scalars and the used block-table rows."""
        used_ints = self.ints.offsets["block_tables"] + num_seqs * self.max_blocks_per_seq
        self.ints.upload(used_ints)
        self.longs.upload()
        self.floats.upload()

    def download(self, num_seqs: int, num_logprobs: int) -> None:
        """D2H of the sampled tokens (and log-probabilities when asked); call on the D2H stream."""
        if self.host_tokens is self.out_tokens:
            return
        self.host_tokens[:num_seqs].copy_(self.out_tokens[:num_seqs], non_blocking=True)
        if num_logprobs >= 0:
            self.host_logprob[:num_seqs].copy_(self.out_logprob[:num_seqs], non_blocking=True)
        if num_logprobs > 0:
            self.host_top_ids[:num_seqs].copy_(self.out_top_ids[:num_seqs], non_blocking=True)
            self.host_top_lp[:num_seqs].copy_(self.out_top_lp[:num_seqs], non_blocking=True)


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
    ints, longs, floats = buf.ints.np, buf.longs.np, buf.floats.np
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
    requests = [s.request for s in scheduled]
    if buf.sampling_rows is None or requests != buf.sampling_rows:  # == compares identities first
        buf.sampling_state = _write_sampling(buf, requests)
    buf.sampling_rows = requests
    all_greedy, any_filter, num_logprobs, any_logits_state = buf.sampling_state
    if pad_tokens_to is not None and pad_tokens_to > t:
        # Padding tokens of a piecewise graph: no KV write and no carry; the attention between the pieces
        # covers only the step's sequences, and no logits row reads them.
        input_ids[t:pad_tokens_to] = 0
        positions[t:pad_tokens_to] = 0
        slot_mapping[t:pad_tokens_to] = -1
        carry_src[t:pad_tokens_to] = -1
    if pad_to is not None and pad_to > num_seqs:
        # Padding rows of a captured decode graph: no KV write, empty context, no carry; sampled inside the
        # graph too, so they get valid greedy parameters whatever the slot held before.
        input_ids[t:pad_to] = 0
        positions[t:pad_to] = 0
        slot_mapping[t:pad_to] = -1
        carry_src[t:pad_to] = -1
        qsl[num_seqs + 1 : pad_to + 1] = np.arange(t + 1, pad_to + 1)
        seq_lens[num_seqs:pad_to] = 0
        floats["temperature"][num_seqs:pad_to] = 0.0
        floats["top_p"][num_seqs:pad_to] = 1.0
        floats["min_p"][num_seqs:pad_to] = 0.0
        ints["top_k"][num_seqs:pad_to] = 0
        longs["seeds"][num_seqs:pad_to] = 0
        sample_pos[num_seqs:pad_to] = 0
    # The decode kernel starts its programs longest context first (load balance over its waves): every row it
    # runs, padding rows included, or a mixed step's leading one-token rows. A stable sort: ties keep row order.
    order_rows = max(num_seqs, pad_to or 0) if decode_only else num_decodes
    if order_rows:
        ints["decode_order"][:order_rows] = np.argsort(-seq_lens[:order_rows], kind="stable")
    seq_used = seq_lens[:num_seqs]
    return StepShape(all_greedy, any_filter, num_logprobs, max_query_len, int(seq_used.max()) if num_seqs else 0,
                     int(seq_used.sum(dtype=np.int64)), num_decodes, any_logits_state)


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
