"""A step as the runner carries it: its plan (what every rank needs besides the slot buffers), the prepared step,
the launched step's handle and the tokens it brings back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.request import Logprobs
from tandem.runner.input_buffers import StepBuffers
from tandem.runner.streams import StepEvents
from tandem.scheduler.output import SchedulerOutput


@dataclass(slots=True)
class StepPlan:
    """A step's shape and sampling choices, decided on rank 0's host; the header of its message to the other ranks."""

    slot: int
    num_seqs: int
    num_tokens: int
    graph_bs: int | None  # None: eager
    all_greedy: bool
    any_top_k_top_p: bool
    num_logprobs: int  # -1: none
    max_query_len: int
    max_seq_len: int
    step_index: int
    timing: bool = False  # ranks record their steps' GPU spans for the timeline
    num_decodes: int = 0  # leading one-token rows (AttentionMetadata.num_decodes)
    piece_tokens: int | None = None  # piecewise graphs: the padded token count; None: a decode graph or eager
    prompt_rows: int = 0  # hidden rows scored for prompt_logprobs (their indices ride in the payload)
    prompt_top_k: int = 0
    num_rows: int = 0  # logits rows sampled: num_seqs, or more in a step that verifies drafts (0: num_seqs)

    @property
    def rows(self) -> int:
        return self.num_rows or self.num_seqs

    @property
    def flat(self) -> bool:
        """A verify step written as one attention row per token (input_buffers.write_flat_verify): its drafts
        sequences have query length k + 1 otherwise, so max_query_len 1 tells the two apart."""
        return self.num_rows > self.num_seqs and self.max_query_len == 1

    @property
    def attention_rows(self) -> int:
        """Rows of the attention metadata (query_start_loc, seq_lens, block tables): sequences, or tokens when flat."""
        return self.num_tokens if self.flat else self.num_seqs

    @property
    def verifies(self) -> bool:
        """Some sequence carries drafts: rows beyond num_seqs, and an accepted count per sequence."""
        return self.num_rows > self.num_seqs

    def fields(self) -> tuple[int, ...]:
        """The plan as the ints of its message header (distributed.ranks.STEP_FIELDS of them)."""
        return (self.slot, self.num_seqs, self.num_tokens, self.graph_bs or 0, self.all_greedy, self.any_top_k_top_p,
                self.num_logprobs, self.max_query_len, self.max_seq_len, self.step_index, self.timing,
                self.num_decodes, self.piece_tokens or 0, self.prompt_rows, self.prompt_top_k, self.num_rows)

    @staticmethod
    def from_fields(h: Any) -> StepPlan:
        v = [int(x) for x in h]
        return StepPlan(v[0], v[1], v[2], v[3] or None, bool(v[4]), bool(v[5]), v[6], v[7], v[8], v[9], bool(v[10]),
                        v[11], v[12] or None, v[13], v[14], v[15])

    def regions(self, buf: StepBuffers) -> list[torch.Tensor]:
        """The host tensors the step fills: ints up to the used block-table rows, all longs and floats."""
        rows = self.graph_bs or self.attention_rows
        used_ints = buf.ints.offsets["block_tables"] + rows * buf.max_blocks_per_seq
        return [buf.ints.cpu[:used_ints], buf.longs.cpu, buf.floats.cpu]


@dataclass(slots=True)
class PreparedStep:
    """A step written into its slot's host buffers and not yet enqueued (ModelRunner.prepare)."""

    sched: SchedulerOutput
    plan: StepPlan
    num_context_tokens: int
    # (logits row of each position, request, drafts) of the requests a host mask constrains (model_runner._mask_rows)
    mask_rows: list[tuple[list[int], Any, list[int]]]
    draft_rows: list[tuple[int, int, int]] | None = None  # (row, first draft row, drafts) of verifying sequences
    shifted: bool = False  # written behind a verify step in flight (ModelExecutor.shift_rows finishes it)


@dataclass(slots=True)
class StepHandle:
    """A launched step: what the CPU needs to read its results once d2h_done fires."""

    sched: SchedulerOutput
    plan: StepPlan
    events: StepEvents
    num_context_tokens: int = 0  # sum of the sequences' context lengths: KV the step reads
    # Rows whose sampling waits for their grammar bitmask, and the logits it will mask; empty once enqueued.
    mask_rows: list[tuple[list[int], Any, list[int]]] | None = None
    logits: torch.Tensor | None = None
    draft_rows: list[tuple[int, int, int]] | None = None  # (row, first draft row, drafts) of verifying sequences
    shifted: bool = False  # its rows moved back on the device by the previous verify step's rejected drafts
    shiftable: bool = False  # an EAGLE-3 chain drafts behind it: a step may be scheduled before it is collected

    @property
    def slot(self) -> int:
        return self.plan.slot

    @property
    def num_seqs(self) -> int:
        return self.plan.num_seqs

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def step_index(self) -> int:
        return self.plan.step_index

    @property
    def sampling_pending(self) -> bool:
        """The forward is enqueued, the sampling not yet (it waits for the grammar rows: launch_sampling)."""
        return self.mask_rows is not None


@dataclass(slots=True)
class StepResult:
    token_ids: list[int]
    logprobs: list[Logprobs] | None
    # (request, index of its first scored prompt token, one entry per token) of the requests with prompt_logprobs
    prompt_logprobs: list[tuple[Any, int, list[Logprobs]]] | None = None
    # Verify steps: row -> (the tokens it produced: accepted drafts and one more, their log-probabilities or None)
    verified: dict[int, tuple[list[int], list[Logprobs] | None]] | None = None
