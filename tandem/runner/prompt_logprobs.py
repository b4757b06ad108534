"""PromptLogprobs: each prompt token's log-probability (and the top k) for the requests that ask, computed from a
step's hidden rows in bounded chunks on the compute stream and brought back with the step's D2H."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.request import Logprobs, Request, RequestStatus
from tandem.scheduler.output import SchedulerOutput

@dataclass(slots=True)
class PromptRows:
    """The rows of one request in a step: hidden row t scores prompt token first_token + (t - first_row)."""

    request: Request
    first_token: int  # index in the prompt of the first token these rows score (>= 1)
    first_row: int  # index of its first row among the step's scored rows
    num_rows: int


@dataclass(slots=True)
class PromptLogprobsPlan:
    segments: list[PromptRows]
    num_rows: int
    top_k: int  # the largest prompt_logprobs of the step's requests (0: the prompt tokens' own only)


class _SlotBuffers:
    """One slot's row indices and targets (pinned host, one packed H2D copy) and results (device, pinned twins)."""

    def __init__(self, max_rows: int, max_top_k: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        # Device buffers are left uninitialized: they are created between steps on whatever stream is current, and
        # a fill kernel there would be unordered with the H2D / compute streams that first write them. Only rows a
        # step wrote are ever read.
        # [2, max_rows]: row 0 the hidden rows to score (token index in the step), row 1 the next prompt token.
        self.index_cpu = torch.zeros(2, max_rows, dtype=torch.int64, pin_memory=cuda)
        self.index_gpu = torch.empty(2, max_rows, dtype=torch.int64, device=device) if cuda else self.index_cpu
        self.index_np = self.index_cpu.numpy()
        self.logprob = torch.empty(max_rows, dtype=torch.float32, device=device)  # [max_rows]
        self.top_ids = torch.empty(max_rows, max(max_top_k, 1), dtype=torch.int64, device=device)  # [max_rows, k]
        self.top_lp = torch.empty(max_rows, max(max_top_k, 1), dtype=torch.float32, device=device)  # [max_rows, k]
        if cuda:
            self.host_logprob = torch.zeros_like(self.logprob, device="cpu").pin_memory()
            self.host_top_ids = torch.zeros_like(self.top_ids, device="cpu").pin_memory()
            self.host_top_lp = torch.zeros_like(self.top_lp, device="cpu").pin_memory()
        else:
            self.host_logprob, self.host_top_ids, self.host_top_lp = self.logprob, self.top_ids, self.top_lp
        self.host_logprob_np = self.host_logprob.numpy()
        self.host_top_ids_np = self.host_top_ids.numpy()
        self.host_top_lp_np = self.host_top_lp.numpy()


class PromptLogprobs:
    """Per-slot plans and buffers of the prompt rows to score. Steps without such a request touch nothing here;
    the buffers are allocated at the first step that has one. `chunk_rows` bounds the rows whose full-vocabulary
    logits exist at once, so a long prompt never materializes [tokens, vocab]."""

    def __init__(self, max_num_tokens: int, max_top_k: int, chunk_rows: int, device: torch.device) -> None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self.max_num_tokens = max_num_tokens
        self.max_top_k = max_top_k
        self.chunk_rows = chunk_rows
        self.device = device
        self.plans: list[PromptLogprobsPlan | None] = [None, None]
        self._slots: list[_SlotBuffers | None] = [None, None]
        # Requests with prompt_logprobs whose prompt rows are not all planned yet, by id (the engine adds them):
        # while it is empty, a step's preparation costs one check.
        self.requests: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def prepare(self, slot: int, sched: SchedulerOutput) -> bool:
        """Host only: writes the step's scored rows into the slot; returns whether it has any.

        A chunk of positions [start, start + n) of a prompt of P tokens scores tokens start + 1 .. min(start + n,
        P - 1): position j's logits give token j + 1's probability, and position P - 1 predicts the first output.
        Token rows are numbered in scheduled order, as write_step lays them out."""
        self.plans[slot] = None
        waiting = self.requests
        if not waiting:
            return False
        segments: list[PromptRows] = []
        token_rows: list[int] = []  # each segment's first row among the step's token rows
        t = num_rows = top_k = 0
        for s in sched.scheduled:
            request = s.request
            start, n = s.num_computed_tokens, s.num_scheduled_tokens
            if request.request_id in waiting:
                last = request.num_prompt_tokens - 1  # the last prompt token's position predicts no prompt token
                end = min(start + n, last)
                if end > start:
                    segments.append(PromptRows(request, start + 1, num_rows, end - start))
                    token_rows.append(t)
                    num_rows += end - start
                    top_k = max(top_k, request.sampling_params.prompt_logprobs or 0)
                if start + n >= last:
                    del waiting[request.request_id]  # every row planned (a recompute after preemption: not again)
            t += n
        for rid in [rid for rid, r in waiting.items() if r.status is RequestStatus.FINISHED]:
            del waiting[rid]  # ended (aborted, failed) before its prompt was scored
        if not segments:
            return False
        rows, targets = self._slot(slot).index_np
        for seg, t in zip(segments, token_rows):
            lo, hi, at = seg.first_row, seg.first_row + seg.num_rows, seg.first_token
            rows[lo:hi] = np.arange(t, t + seg.num_rows)
            targets[lo:hi] = seg.request.prompt_token_ids[at : at + seg.num_rows]
        self.plans[slot] = PromptLogprobsPlan(segments, num_rows, top_k)
        return True

    def _slot(self, slot: int) -> _SlotBuffers:
        buf = self._slots[slot]
        if buf is None:
            buf = self._slots[slot] = _SlotBuffers(self.max_num_tokens, self.max_top_k, self.device)
        return buf

    def plan_shape(self, slot: int) -> tuple[int, int]:
        """(rows, top k) of the slot's plan, (0, 0) without one: what a tensor-parallel step header carries."""
        plan = self.plans[slot]
        return (plan.num_rows, plan.top_k) if plan is not None else (0, 0)

    def regions(self, slot: int) -> list[torch.Tensor]:
        """Rank 0 with tensor parallelism: the slot's host rows and targets, sent with the step to the other ranks
        (every rank runs the lm_head's all-gather on the same rows)."""
        plan, buf = self.plans[slot], self._slots[slot]
        if plan is None or buf is None:
            return []
        return [buf.index_cpu[0, : plan.num_rows], buf.index_cpu[1, : plan.num_rows]]

    def receive(self, slot: int, num_rows: int, top_k: int) -> list[torch.Tensor]:
        """The other ranks: takes rank 0's plan of `num_rows` rows (no requests: nothing is read back here) and
        returns the host regions its rows and targets arrive in."""
        if num_rows == 0:
            self.plans[slot] = None
            return []
        self.plans[slot] = PromptLogprobsPlan([], num_rows, top_k)
        buf = self._slot(slot)
        return [buf.index_cpu[0, :num_rows], buf.index_cpu[1, :num_rows]]

    def upload(self, slot: int) -> None:
        """H2D of the slot's row indices and targets (call on the H2D stream)."""
        plan, buf = self.plans[slot], self._slots[slot]
        if plan is None or buf is None or buf.index_gpu is buf.index_cpu:
            return
        buf.index_gpu[:, : plan.num_rows].copy_(buf.index_cpu[:, : plan.num_rows], non_blocking=True)

    def compute(self, slot: int, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Scores the slot's rows of `hidden` [num_tokens, hidden_size] (call on the compute stream): per chunk of
        rows, the full-vocabulary logits, their log-softmax in fp32, the next prompt token's logprob and the top k."""
        plan, buf = self.plans[slot], self._slots[slot]
        if plan is None or buf is None:
            return
        rows_gpu, targets_gpu = buf.index_gpu[0], buf.index_gpu[1]
        k = plan.top_k
        for c0 in range(0, plan.num_rows, self.chunk_rows):
            c1 = min(plan.num_rows, c0 + self.chunk_rows)
            logits = compute_logits(hidden.index_select(0, rows_gpu[c0:c1]))  # [c, vocab] in the model dtype
            # One pass from the model dtype to fp32 log-probabilities (no separate upcast, max and subtraction).
            logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [c, vocab]
            del logits
            buf.logprob[c0:c1].copy_(logprobs.gather(1, targets_gpu[c0:c1, None]).squeeze(1))
            if k == 1:  # a max reduction, cheaper than topk's selection
                values, ids = logprobs.max(dim=-1, keepdim=True)
            elif k > 1:
                values, ids = logprobs.topk(k, dim=-1)
            if k > 0:
                buf.top_lp[c0:c1, :k].copy_(values)
                buf.top_ids[c0:c1, :k].copy_(ids)

    def download(self, slot: int) -> None:
        """D2H of the slot's results (call on the D2H stream, after the compute stream's compute_done)."""
        plan, buf = self.plans[slot], self._slots[slot]
        if plan is None or buf is None or buf.host_logprob is buf.logprob:
            return
        n, k = plan.num_rows, plan.top_k
        buf.host_logprob[:n].copy_(buf.logprob[:n], non_blocking=True)
        if k > 0:
            buf.host_top_ids[:n].copy_(buf.top_ids[:n], non_blocking=True)
            buf.host_top_lp[:n].copy_(buf.top_lp[:n], non_blocking=True)

    def read(self, slot: int) -> list[tuple[Request, int, list[Logprobs]]]:
        """After the step's D2H: (request, index of the first prompt token scored, one entry per token) for each
        request of the step that asked, each cut to its own top k. Clears the slot's plan."""
        plan, buf = self.plans[slot], self._slots[slot]
        self.plans[slot] = None
        if plan is None or buf is None:
            return []
        n = plan.num_rows
        chosen = buf.host_logprob_np[:n].tolist()
        top_ids_np, top_lp_np = buf.host_top_ids_np, buf.host_top_lp_np
        results: list[tuple[Request, int, list[Logprobs]]] = []
        for seg in plan.segments:
            k = seg.request.sampling_params.prompt_logprobs or 0
            lo, hi = seg.first_row, seg.first_row + seg.num_rows
            ids, lps = top_ids_np[lo:hi, :k].tolist(), top_lp_np[lo:hi, :k].tolist()
            results.append((seg.request, seg.first_token,
                            [(chosen[lo + i], list(zip(ids[i], lps[i]))) for i in range(seg.num_rows)]))
        return results
