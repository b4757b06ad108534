"""Request: the CPU-side state of one request as the scheduler and engine see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.lora_request import LoRARequest
from tandem.sampling_params import SamplingParams

# One sampled token's log-probability and the top-n (token id, log-probability) pairs beside it.
Logprobs = tuple[float, list[tuple[int, float]]]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller or failed by an engine error

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int  # change it through limit_context(), which keeps max_output_tokens in step
    sampling_seed: int  # the seed the sampler uses: the user's, or one drawn by the engine
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + known outputs
    num_computed_tokens: int = 0  # advanced when a step is scheduled, not when it finishes
    num_pending_tokens: int = 0  # sampled by steps in flight, not yet known on the CPU (<= 1 when scheduled, 2 briefly in overlap)
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # set when an engine error failed the request
    # One entry per output token when logprobs were asked for: (chosen logprob, [(token id, logprob)] top-n).
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # With prompt_logprobs: entry j is prompt token j + 1's (its logprob, [(token id, logprob)] top-k), in order;
    # the engine hands them out with the request's first output (prompt_logprobs_sent).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Tokens banned outright (single-token bad words) and multi-token bad words, resolved by the engine.
    banned_token_ids: tuple[int, ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # The CPU-side next-token constraint (structured.HostMask: a grammar and/or multi-token bad words), or None.
    host_mask: Any = None
    first_scheduled_time: float | None = None
    # The LoRA adapter it runs with (None: the base model) and, while admitted, the device slot holding it.
    lora_request: LoRARequest | None = None
    lora_slot: int = -1
    # Times its adapter's id was removed before this request came (EngineCore.remove_lora): part of its prefix-cache
    # key, so blocks computed before an unload are never served to the id loaded again (its folder may have changed).
    lora_epoch: int = 0
    # Steps in which it waited for an adapter slot while a later request was admitted onto one (the scheduler's
    # starvation bound, SchedulerConfig.max_lora_skips).
    num_lora_skips: int = 0
    first_token_time: float | None = None
    # Speculative decoding: the tokens proposed for the next step (set before it is scheduled, consumed by it),
    # the most the proposer may offer this request (shrinks after rejections, grows after full acceptance),
    # and the request's totals of proposed and accepted draft tokens.
    draft_token_ids: list[int] = field(default_factory=list)
    spec_k: int = 0
    # Drafts of verify steps in flight (uncollected): their positions count in num_computed_tokens as if every draft
    # were accepted, so the next step can be scheduled before the accepted counts are known (the device moves its
    # positions back by the rejected ones: ModelExecutor.shift_rows).
    num_drafts_in_flight: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Output tokens appended by the last step that produced any (more than one after a verify step).
    num_new_tokens: int = 0
    # The output length at which the request stops for length (max_tokens or the context); a field, not a
    # property, because the scheduler and the stop check read it for every request in every step.
    max_output_tokens: int = field(init=False)
    # Every token that may end the request (EOS unless ignored, and the stop token ids): the per-step stop
    # check runs check_stop() only for these tokens or at the length limit.
    stop_token_set: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self.limit_context(self.max_model_len)
        sp = self.sampling_params
        self.stop_token_set = (frozenset() if sp.ignore_eos else self.eos_token_ids) | frozenset(sp.stop_token_ids)

    def limit_context(self, max_model_len: int) -> None:
        """Sets the context limit and the output length it allows."""
        self.max_model_len = max_model_len
        by_context = max_model_len - len(self.prompt_token_ids)
        mt = self.sampling_params.max_tokens
        self.max_output_tokens = by_context if mt is None else min(mt, by_context)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known on the CPU (prompt + outputs)."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens that exist or are being sampled right now: what the next step may compute up to."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def add_prompt_logprobs(self, first_token: int, entries: list[tuple[float, list[tuple[int, float]]]]) -> None:
        """Records the scores of prompt tokens first_token.. (in order); tokens scored before (a recompute after
        preemption scores them again) are skipped."""
        have = len(self.prompt_logprobs) + 1  # the next prompt token without a score (token 0 never has one)
        if first_token + len(entries) > have:
            assert first_token <= have, f"{self.request_id}: prompt token {have} was never scored"
            self.prompt_logprobs.extend(entries[have - first_token :])

    def check_stop(self) -> bool:
        """Sets finish_reason if the last output token ends the request; returns whether it does."""
        num_output = len(self.output_token_ids)
        if num_output == 0:
            return False
        token = self.output_token_ids[-1]
        sp = self.sampling_params
        if num_output >= sp.min_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, None
                return True
            if token in sp.stop_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, token
                return True
        if num_output >= self.max_output_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False
