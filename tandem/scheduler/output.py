"""SchedulerOutput: what one step computes, as the scheduler hands it to the runner."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # start position of this step's tokens
    num_scheduled_tokens: int
    token_ids: list[int]  # input ids of positions [start, start+n); a pending position holds placeholder 0
    carry: bool  # the LAST input position is the placeholder for the token the previous step samples
    block_ids: list[int]  # the request's whole block table (read-only for the runner)
    sample: bool  # this step's last position yields a new output token


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_request_ids: list[str]
