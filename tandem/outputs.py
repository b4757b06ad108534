"""EngineOutput (one step's result for one request, also its wire form) and RequestOutput / CompletionOutput:
what the engine, generate() and the server hand back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tandem.request import FinishReason, Logprobs

# Per output token: {token_id: logprob} holding the chosen token and the top-n alternatives.
SampleLogprobs = list[dict[int, float]]

# Per prompt token: None for the first (nothing precedes it), then {token_id: logprob} holding the prompt token
# itself and the top-k alternatives given the tokens before it.
PromptLogprobs = list[dict[int, float] | None]


def prompt_logprobs_dicts(prompt_token_ids: list[int], entries: list[Logprobs]) -> PromptLogprobs:
    """The engine's per-token entries (entry j scores prompt token j + 1) as one dict per prompt token."""
    out: PromptLogprobs = [None]
    for token, (logprob, top) in zip(prompt_token_ids[1:], entries):
        entry = dict(top)
        entry[token] = logprob
        out.append(entry)
    return out


class EngineOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step produced for one request. A msgspec struct because the engine-core process sends these
    objects themselves to the API processes: no per-token copy into another message type. Not tracked by the
    cycle collector (gc=False): it holds only lists of numbers, strings and enums, so it can be in no cycle,
    and a busy engine makes one per request per step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    queue_time: float | None = None  # seconds from arrival to first scheduling
    # With prompt_logprobs, on the request's first output only: entry j scores prompt token j + 1.
    prompt_logprobs: list[Logprobs] | None = None
    # Speculative decoding, on the request's last output: draft tokens proposed for it and accepted, in total.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    error: str | None = None  # why the engine ended it (finish_reason "error")

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs: one entry per prompt token
