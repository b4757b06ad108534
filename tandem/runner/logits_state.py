"""Per-request device state that shapes logits before sampling: output-token counts, prompt-token masks and a
bias row (logit_bias, allowed_token_ids, single-token bad words), updated from the sampled tokens on the GPU.

A request that uses any of them holds one state row (of max_num_seqs) while it runs; the row is written once
from the request's known tokens when it first appears in a step (or comes back after preemption) and then kept
current on the device by counting each step's sampled token right after sampling, in stream order. So the
next step's penalties see the previous token without a host round trip, with overlap as in sync. A step in
which no request holds a row runs none of this.

Row `max_num_seqs` is all zeros (read by rows without state); row `max_num_seqs + 1` takes the counts of
rows whose sampled token is discarded (not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.request import Request, RequestStatus
from tandem.scheduler.output import ScheduledRequest


class _Staging:
    """Growable pinned host array and its device twin (grown only when a step needs more than ever before)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int = 1024) -> None:
        self.dtype, self.device = dtype, device
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        cuda = self.device.type == "cuda"
        self.cpu = torch.zeros(capacity, dtype=self.dtype, pin_memory=cuda)
        self.gpu = torch.zeros(capacity, dtype=self.dtype, device=self.device) if cuda else self.cpu
        self.np = self.cpu.numpy()
        self.n = 0

    def write(self, values: list[int] | list[float] | np.ndarray) -> None:
        n = len(values)
        if n > len(self.np):
            self._alloc(max(n, 2 * len(self.np)))
        self.np[:n] = values
        self.n = n

    def upload(self) -> None:
        if self.n and self.gpu is not self.cpu:
            self.gpu[: self.n].copy_(self.cpu[: self.n], non_blocking=True)

    def dev(self) -> torch.Tensor:
        return self.gpu[: self.n]


@dataclass(slots=True)
class LogitsPlan:
    """What one step's logits processing runs (host flags: the kernels a step needs, chosen without a sync)."""

    num_rows: int
    any_repetition: bool
    any_presence_frequency: bool
    any_bias: bool
    num_inits: int
    verifies: bool = False  # a verify step: its rows count their sampled tokens only where kept (count's keep)


class _SlotStaging:
    """One A/B slot's staged inputs of the logits processing."""

    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        self.row_state = _Staging(torch.int64, device, max_num_seqs)  # state row read by each batch row
        self.count_state = _Staging(torch.int64, device, max_num_seqs)  # state row counting each sampled token
        self.params = _Staging(torch.float32, device, 3 * max_num_seqs)  # repetition | presence | frequency
        self.init_rows = _Staging(torch.int64, device, max_num_seqs)
        self.init_fill = _Staging(torch.float32, device, max_num_seqs)  # bias base: 0, or -inf (allowed ids)
        self.prompt_idx = _Staging(torch.int64, device)  # flat state_row * V + token of prompt tokens
        self.output_idx = _Staging(torch.int64, device)  # the same for output tokens (repeated: counts)
        self.bias_idx = _Staging(torch.int64, device)
        self.bias_val = _Staging(torch.float32, device)
        # A verify step's drafts before each row (flat batch_row * V + token): counted for that row's penalties.
        self.draft_idx = _Staging(torch.int64, device)

    def all(self) -> list[_Staging]:
        return [self.row_state, self.count_state, self.params, self.init_rows, self.init_fill, self.prompt_idx,
                self.output_idx, self.bias_idx, self.bias_val, self.draft_idx]


class LogitsState:
    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.device = device
        self.zero_row, self.trash_row = max_num_seqs, max_num_seqs + 1
        self.counts: torch.Tensor | None = None  # [max_num_seqs + 2, V] int32, allocated at first use
        self.prompt_mask: torch.Tensor | None = None  # [max_num_seqs + 2, V] bool
        self.bias: torch.Tensor | None = None  # [max_num_seqs + 2, V] float32
        self.held: dict[str, tuple[Request, int]] = {}  # request id -> (request, state row)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.staging = [_SlotStaging(max_num_seqs, device) for _ in range(2)]
        self.plans: list[LogitsPlan | None] = [None, None]

    def _allocate(self) -> None:
        rows, v = self.max_num_seqs + 2, self.vocab_size
        self.counts = torch.zeros(rows, v, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(rows, v, dtype=torch.bool, device=self.device)
        self.bias = torch.zeros(rows, v, dtype=torch.float32, device=self.device)
        self._one = torch.ones((), dtype=torch.int32, device=self.device)

    def _release_done(self) -> None:
        done = [rid for rid, (req, _) in self.held.items()
                if req.status is RequestStatus.FINISHED or req.status is RequestStatus.WAITING]
        for rid in done:
            self.free_rows.append(self.held.pop(rid)[1])

    def prepare(self, slot: int, scheduled: list[ScheduledRequest], any_state: bool,
                draft_rows: list[tuple[int, int, int]] | None = None, num_rows: int = 0) -> LogitsPlan | None:
        """Writes the step's host inputs into the slot's staging; None when no row uses logits state
        (`any_state`, which write_step derives only when the batch's requests change). A verify step
        (draft_rows: (sequence, first draft row, drafts) of each sequence with drafts, num_rows rows in all) gives
        each draft row its sequence's state and parameters, and counts the drafts before a row (draft j's row:
        drafts 0..j-1; the sequence's own row: all of them) into that row's penalties as if already output."""
        if self.held:
            self._release_done()
        if not any_state:
            self.plans[slot] = None
            return None
        if self.counts is None:
            self._allocate()
        st = self.staging[slot]
        v = self.vocab_size
        n = len(scheduled)
        row_state = [self.zero_row] * n
        count_state = [self.trash_row] * n
        params = np.zeros((3, n), dtype=np.float32)
        params[0] = 1.0
        init_rows: list[int] = []
        init_fill: list[float] = []
        prompt_idx: list[np.ndarray] = []
        output_idx: list[np.ndarray] = []
        bias_idx: list[np.ndarray] = []
        bias_val: list[np.ndarray] = []
        any_rep = any_pf = any_bias = False
        for i, s in enumerate(scheduled):
            req = s.request
            sp = req.sampling_params
            if not sp.uses_logits_state:
                continue
            held = self.held.get(req.request_id)
            if held is None or held[0] is not req:
                row = self.free_rows.pop()
                self.held[req.request_id] = (req, row)
                init_rows.append(row)
                base = row * v
                prompt_idx.append(base + np.unique(np.asarray(req.prompt_token_ids, dtype=np.int64)))
                output_idx.append(base + np.asarray(req.output_token_ids, dtype=np.int64))
                bias = token_bias(req)
                init_fill.append(float("-inf") if sp.allowed_token_ids is not None else 0.0)
                if bias:
                    bias_idx.append(base + np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)))
                    bias_val.append(np.fromiter(bias.values(), dtype=np.float32, count=len(bias)))
            else:
                row = held[1]
            row_state[i] = row
            if s.sample:
                count_state[i] = row
            params[:, i] = (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty)
            any_rep |= sp.repetition_penalty != 1.0
            any_pf |= sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
            any_bias |= bool(sp.logit_bias) or sp.allowed_token_ids is not None or bool(req.banned_token_ids)
        draft_idx: list[int] = []
        if draft_rows:
            row_state, count_state, params = self._draft_rows(scheduled, draft_rows, num_rows, row_state,
                                                              count_state, params, draft_idx)
        st.draft_idx.write(draft_idx)
        st.row_state.write(row_state)
        st.count_state.write(count_state)
        st.params.write(params.reshape(-1))
        st.init_rows.write(init_rows)
        st.init_fill.write(init_fill)
        empty = np.zeros(0, dtype=np.int64)
        st.prompt_idx.write(np.concatenate(prompt_idx) if prompt_idx else empty)
        st.output_idx.write(np.concatenate(output_idx) if output_idx else empty)
        st.bias_idx.write(np.concatenate(bias_idx) if bias_idx else empty)
        st.bias_val.write(np.concatenate(bias_val) if bias_val else np.zeros(0, dtype=np.float32))
        plan = LogitsPlan(len(row_state), any_rep, any_pf, any_bias, len(init_rows), verifies=bool(draft_rows))
        self.plans[slot] = plan
        return plan

    def _draft_rows(self, scheduled: list[ScheduledRequest], draft_rows: list[tuple[int, int, int]], num_rows: int,
                    row_state: list[int], count_state: list[int], params: np.ndarray, draft_idx: list[int]
                    ) -> tuple[list[int], list[int], np.ndarray]:
        """The verify step's rows past the sequences' own: each draft row reads and counts into its sequence's
        state row with its parameters; draft_idx gets every row's preceding drafts."""
        n, v = len(scheduled), self.vocab_size
        row_state = row_state + [self.zero_row] * (num_rows - n)
        count_state = count_state + [self.trash_row] * (num_rows - n)
        wide = np.zeros((3, num_rows), dtype=np.float32)
        wide[0] = 1.0
        wide[:, :n] = params
        for i, first, k in draft_rows:
            if row_state[i] == self.zero_row:  # no logits state: its draft rows read the zero row
                continue
            drafts = scheduled[i].token_ids[-k:]
            for j in range(k):
                row_state[first + j] = row_state[i]
                count_state[first + j] = row_state[i]
                wide[:, first + j] = params[:, i]
                draft_idx.extend((first + j) * v + t for t in drafts[:j])
            draft_idx.extend(i * v + t for t in drafts)
        return row_state, count_state, wide

    def upload(self, slot: int) -> None:
        """H2D of the slot's staged inputs (call on the H2D stream, before its h2d_done)."""
        if self.plans[slot] is not None:
            for staged in self.staging[slot].all():
                staged.upload()

    def apply(self, slot: int, logits: torch.Tensor) -> None:
        """Initialises new state rows, then applies penalties and bias to logits [>= num_rows, V] in place."""
        plan = self.plans[slot]
        if plan is None:
            return
        st = self.staging[slot]
        counts, prompt_mask, bias = self.counts, self.prompt_mask, self.bias
        assert counts is not None and prompt_mask is not None and bias is not None
        logits = logits[: plan.num_rows]  # a verify step's draft rows too; padding rows never
        if plan.num_inits:
            rows = st.init_rows.dev()
            counts.index_fill_(0, rows, 0)
            prompt_mask.index_fill_(0, rows, False)
            bias.index_copy_(0, rows, st.init_fill.dev()[:, None].expand(-1, self.vocab_size))
            if st.prompt_idx.n:
                prompt_mask.view(-1).index_fill_(0, st.prompt_idx.dev(), True)
            if st.output_idx.n:
                counts.view(-1).index_put_((st.output_idx.dev(),), self._one, accumulate=True)
            if st.bias_idx.n:
                bias.view(-1).index_copy_(0, st.bias_idx.dev(), st.bias_val.dev())
        n = plan.num_rows
        rows = st.row_state.dev()
        params = st.params.dev().view(3, n)
        x = logits.float()
        if plan.any_repetition or plan.any_presence_frequency:
            row_counts = counts.index_select(0, rows)  # [n, V]
            if st.draft_idx.n:  # a verify row's penalties see the drafts before it as output tokens
                row_counts.view(-1).index_put_((st.draft_idx.dev(),), self._one, accumulate=True)
            if plan.any_repetition:
                seen = prompt_mask.index_select(0, rows) | (row_counts > 0)
                rep = params[0][:, None]
                x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            if plan.any_presence_frequency:
                x = x - params[2][:, None] * row_counts - params[1][:, None] * (row_counts > 0)
        if plan.any_bias:
            x = x + bias.index_select(0, rows)
        logits.copy_(x)

    def count(self, slot: int, token_ids: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Adds each row's sampled token ([>= num_rows]) to its state row's counts (after sampling, same stream); in a
        verify step only the rows `keep` marks ([num_rows] int32, 1: the row's token is an output token)."""
        plan = self.plans[slot]
        if plan is None:
            return
        assert self.counts is not None and (keep is not None) == plan.verifies
        idx = self.staging[slot].count_state.dev() * self.vocab_size + token_ids[: plan.num_rows]
        self.counts.view(-1).index_put_((idx,), self._one if keep is None else keep[: plan.num_rows],
                                        accumulate=True)


def token_bias(req: Request) -> dict[int, float]:
    """The request's sparse bias row: 0 on allowed ids (the rest of the row is -inf), logit_bias added, and -inf
    on banned single tokens."""
    sp = req.sampling_params
    bias: dict[int, float] = {}
    if sp.allowed_token_ids is not None:
        bias = dict.fromkeys(sp.allowed_token_ids, 0.0)
    for token, value in (sp.logit_bias or {}).items():
        if sp.allowed_token_ids is None or token in bias:
            bias[token] = float(value)
    for token in req.banned_token_ids:
        bias[token] = float("-inf")
    return bias
