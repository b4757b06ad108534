"""Generation: one HTTP request's engine requests (prompts x n), gathered into per-choice text and usage."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.detokenizer import IncrementalDetokenizer
from tandem.engine.client import Accepted, AsyncEngine, Failed, Rejected, is_terminal
from tandem.request import FinishReason
from tandem.sampling_params import SamplingParams
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import ApiError, PromptTokensDetails, Usage

# One output token with logprobs: (token id, chosen logprob, [(token id, logprob)] top-n).
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


@dataclass(slots=True)
class Prompt:
    text: str | None
    token_ids: list[int]


@dataclass(slots=True)
class Choice:
    index: int
    request_id: str
    prompt_index: int
    detok: IncrementalDetokenizer | TokenCounter
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    queue_time_s: float | None = None  # admission wait, when the engine's outputs report it
    # With prompt_logprobs: entry j is prompt token j + 1's (logprob, [(token id, logprob)] top-k).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass(slots=True)
class Delta:
    """What one batch of engine items added to one choice."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def empty(self, text_only: bool) -> bool:
        """Nothing to send: no text (or, without a tokenizer, no tokens), logprobs or finish."""
        news = self.text if text_only else self.token_ids
        return not news and not self.logprobs and self.finish_reason is None


class Generation:
    """Submits prompts x n engine requests and folds their outputs into choices.

    Choice k serves prompt k // n. Seeds differ per choice (seed + j) so n samples are not copies.
    """

    def __init__(self, engine: AsyncEngine, tokenizer: Any, metrics: ServerMetrics, request_id: str,
                 prompts: list[Prompt], n: int, params: SamplingParams, arrival: float,
                 lora_request: Any = None, model: str = "") -> None:
        self.engine = engine
        self.metrics = metrics
        self.request_id = request_id
        self.prompts = prompts
        self.arrival = arrival
        self.error: str | None = None
        self.error_status = 500
        self.created = int(time.time())
        self.model = model  # the name responses carry: the served model's, or the adapter's
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending: list[Any] = []  # items that arrived while waiting for acknowledgements
        self.choices: list[Choice] = []
        submissions = []
        for prompt_index, prompt in enumerate(prompts):
            for j in range(n):
                index = prompt_index * n + j
                sub_id = f"{request_id}-{index}"
                seed = None if params.seed is None else (params.seed + j) % 2**63
                sub_params = _with(params, n=1, seed=seed)
                detok = (IncrementalDetokenizer(tokenizer, prompt.token_ids, sub_params) if tokenizer is not None
                         else TokenCounter())
                self.choices.append(Choice(index, sub_id, prompt_index, detok))
                submissions.append((sub_id, prompt.token_ids, sub_params))
        self._by_id = {c.request_id: c for c in self.choices}
        # QueueFullError / EngineUnavailableError propagate
        if lora_request is None:
            engine.add(submissions, self._queue)
        else:  # every choice runs with the adapter the request's `model` names
            engine.add(submissions, self._queue, lora_request)

    @property
    def done(self) -> bool:
        return self.error is not None or all(c.finish_reason is not None for c in self.choices)

    async def wait_accepted(self) -> None:
        """Waits until the engine took every request; a rejection aborts the rest and becomes a 400."""
        waiting = {c.request_id for c in self.choices}
        while waiting:
            item = await self._queue.get()
            if isinstance(item, Accepted):
                waiting.discard(item.request_id)
                self.metrics.prompt_tokens.inc(len(self.prompts[self._by_id[item.request_id].prompt_index].token_ids))
            elif isinstance(item, Rejected):
                self.abort_unfinished(record="rejected")
                if item.status == 429:
                    raise ApiError(429, item.message, type="rate_limit_error", code="queue_full")
                raise ApiError(400, item.message, param=_param_of(item.message))
            else:
                self._pending.append(item)
                if is_terminal(item):  # failed before it was accepted: nothing more will come
                    waiting.discard(item.request_id)

    async def next_batch(self) -> dict[int, Delta]:
        """Waits for engine items, takes all that are ready, returns the deltas by choice index."""
        items = self._pending or [await self._queue.get()]
        self._pending = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        deltas: dict[int, Delta] = {}
        for item in items:
            choice = self._by_id[item.request_id]
            if choice.finish_reason is not None or self.error is not None:
                continue
            self._apply(choice, item, deltas.setdefault(choice.index, Delta()))
        num_new = sum(len(d.token_ids) for d in deltas.values())
        if num_new:  # one counter update per batch: multiprocess-mode counters write to shared files
            self.metrics.generation_tokens.inc(num_new)
        if self.error is not None:
            self.abort_unfinished()
        return deltas

    async def run_to_completion(self) -> None:
        while not self.done:
            await self.next_batch()

    def abort_unfinished(self, record: str = "abort") -> None:
        """Client gone or request failed: free every engine request still running.

        record="abort" counts them as aborted in /metrics; "rejected" (a 400) does not count them.
        """
        now = time.monotonic()
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.finish_reason = record
                self.engine.abort(choice.request_id, FinishReason.ABORT)
                if record == "abort":
                    self.metrics.observe_finished("abort", self.arrival, choice.first_token_time, now,
                                                  len(choice.token_ids))

    def usage(self) -> Usage:
        num_prompt = sum(len(p.token_ids) for p in self.prompts)
        num_completion = sum(len(c.token_ids) for c in self.choices)
        cached = [0] * len(self.prompts)
        for c in self.choices:
            cached[c.prompt_index] = max(cached[c.prompt_index], c.num_cached_tokens)
        return Usage(prompt_tokens=num_prompt, completion_tokens=num_completion,
                     total_tokens=num_prompt + num_completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached)))

    def server_metrics(self) -> dict[str, float] | None:
        """Extension figures for the final response: the longest admission wait of the choices."""
        waits = [c.queue_time_s for c in self.choices if c.queue_time_s is not None]
        return {"queue_time_s": max(waits)} if waits else None

    def _apply(self, choice: Choice, item: Any, delta: Delta) -> None:
        now = time.monotonic()
        if isinstance(item, Failed) or getattr(item, "error", None):
            self.error = item.message if isinstance(item, Failed) else item.error
            # 503: the request's engine replica died or hung, or the server shuts down; 500: its step failed.
            self.error_status = item.status if isinstance(item, Failed) else 500
            choice.finish_reason = "error"
            self.metrics.request_failure.inc()
            return
        before = choice.detok.num_output_tokens
        text, stop = choice.detok.update(item.new_token_ids)
        consumed = choice.detok.num_output_tokens - before  # tokens after a stop string are dropped
        new_ids = item.new_token_ids[:consumed]
        if new_ids and choice.first_token_time is None:
            choice.first_token_time = now
        choice.num_cached_tokens = item.num_cached_tokens
        prompt_logprobs = getattr(item, "prompt_logprobs", None)
        if prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs
        queue_time = getattr(item, "queue_time", None)
        if queue_time is not None:
            choice.queue_time_s = float(queue_time)
        choice.token_ids.extend(new_ids)
        delta.token_ids.extend(new_ids)
        if item.new_logprobs:
            entries = [(t, lp[0], list(lp[1])) for t, lp in zip(new_ids, item.new_logprobs[:consumed])]
            choice.logprobs.extend(entries)
            delta.logprobs.extend(entries)
        if stop is not None:
            choice.finish_reason, choice.stop_reason = "stop", stop
            if not item.finished:
                self.engine.abort(choice.request_id, FinishReason.STOP, stop)
        elif item.finished:
            text += choice.detok.flush()
            reason = item.finish_reason
            choice.finish_reason = str(reason) if reason is not None else "stop"
            choice.stop_reason = item.stop_reason
        choice.text_parts.append(text)
        delta.text += text
        if choice.finish_reason is not None:
            delta.finish_reason, delta.stop_reason = choice.finish_reason, choice.stop_reason
            self.metrics.observe_finished(choice.finish_reason, self.arrival, choice.first_token_time, now,
                                          len(choice.token_ids))


class TokenCounter:
    """Stands in for IncrementalDetokenizer when the model has no tokenizer: counts tokens, no text."""

    def __init__(self) -> None:
        self.num_output_tokens = 0

    def update(self, new_token_ids: list[int]) -> tuple[str, None]:
        self.num_output_tokens += len(new_token_ids)
        return "", None

    def flush(self) -> str:
        return ""


def _with(params: SamplingParams, **changes: Any) -> SamplingParams:
    values = {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}
    values.update(changes)
    return SamplingParams(**values)


SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__) | {"prompt", "messages", "prompt_token_ids"}


def _param_of(message: str) -> str | None:
    """The field a ValueError message names first ('max_tokens must be ...' -> 'max_tokens')."""
    word = message.split(" ", 1)[0].strip(":,.'\"")
    return word if word in SAMPLING_FIELDS else None
