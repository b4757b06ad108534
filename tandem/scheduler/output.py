"""SchedulerOutput: what one step computes, as the scheduler hands it to the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tandem.lora_request import LoRARequest
from tandem.request import Request


def draft_stand_in(index: int) -> int:
    """The input id standing for a draft a device proposer left on the device, at `index` of its flattened
    output: -2, -3, ... (never a token id, nor -1, which marks a row without a draft). The runner swaps them for
    the drafts on the device before the forward (ModelExecutor.take_drafts)."""
    return -2 - index


def row_stand_ins(row: int, k: int, width: int) -> list[int]:
    """The stand-ins of the first k drafts in row `row` of a device proposer's [rows, width] output."""
    return [draft_stand_in(row * width + j) for j in range(k)]


class ScheduledRequest(msgspec.Struct, gc=False):
    """One request's share of a step. A msgspec struct for its C constructor: the scheduler builds one per
    running request per step (a slotted dataclass's __init__ cost ~8x more). Not GC-tracked: it refers to its
    Request, and nothing refers back."""

    request: Request
    num_computed_tokens: int  # start position of this step's tokens
    num_scheduled_tokens: int
    token_ids: list[int]  # input ids of positions [start, start+n); a pending position holds placeholder 0
    carry: bool  # the LAST input position is the placeholder for the token the previous step samples
    block_ids: list[int]  # the request's whole block table (read-only for the runner)
    sample: bool  # this step's last position yields a new output token
    # Speculative decoding: the last num_draft input ids are proposed tokens the step verifies (then `sample`), or
    # draft_stand_in ids where the proposer's drafts stay on the device;
    # the step yields 1 to num_draft + 1 tokens, and the positions of rejected drafts are rolled back.
    num_draft: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_request_ids: list[str]
    num_draft_tokens: int = 0  # proposed tokens the step verifies (0: a plain step)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)  # (slot, adapter) to page in first
    # A page-in overwrites a slot the step in flight may still read: the copies wait for that step's compute.
    lora_loads_wait: bool = False
