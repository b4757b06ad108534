"""SamplingParams: how one request samples and when it stops (validated once, then frozen)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """One constraint on the output: a JSON schema (as a JSON string), any JSON object, a regex, a choice among
    strings, or an EBNF grammar (GBNF syntax, root rule `root`). Exactly one is set."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def kind(self) -> str:
        set_ = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise ValueError(f"structured_output must set exactly one of json, json_object, regex, choice, grammar; "
                             f"got {set_ or 'none'}")
        return set_[0]

    def key(self) -> tuple[str, str]:
        """The cache key of the compiled grammar: (kind, spec)."""
        kind = self.kind()
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, "\x00".join(self.choice or ())
        return kind, str(getattr(self, kind))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: the chosen token only; n: plus the top n
    # None: none; 0: each prompt token's own log-probability given the tokens before it; k: plus the top k
    prompt_logprobs: int | None = None
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    structured_output: StructuredOutputParams | None = None

    def __init__(
        self,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        stop: str | list[str] | tuple[str, ...] | None = None,
        stop_token_ids: list[int] | tuple[int, ...] | None = None,
        ignore_eos: bool = False,
        seed: int | None = None,
        logprobs: int | None = None,
        n: int = 1,
        prompt_logprobs: int | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        min_p: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        allowed_token_ids: list[int] | tuple[int, ...] | None = None,
        bad_words: str | list[str] | tuple[str, ...] | None = None,
        structured_output: StructuredOutputParams | None = None,
    ) -> None:
        stops: tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        values = dict(
            temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
            min_tokens=min_tokens, stop=stops, stop_token_ids=tuple(stop_token_ids or ()),
            ignore_eos=ignore_eos, seed=seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=n,
            include_stop_str_in_output=include_stop_str_in_output,
            skip_special_tokens=skip_special_tokens, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, min_p=min_p,
            logit_bias=dict(logit_bias) if logit_bias else None,
            allowed_token_ids=tuple(allowed_token_ids) if allowed_token_ids is not None else None,
            bad_words=(bad_words,) if isinstance(bad_words, str) else tuple(bad_words or ()),
            structured_output=structured_output,
        )
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be >= 1 unless prompt_logprobs is set (max_tokens=0 scores the prompt "
                             "without generating)")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        self._validate_logits_fields(is_int)

    def _validate_logits_fields(self, is_int) -> None:  # type: ignore[no-untyped-def]
        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            x = getattr(self, name)
            if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
                raise ValueError(f"{name} must be a number, got {x!r}")
            if not (lo < x if lo_open else lo <= x) or not x <= hi:
                raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {x}")

        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, math.inf, lo_open=True)
        number("min_p", 0.0, 1.0)
        for token, bias in (self.logit_bias or {}).items():
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if any(not is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be token ids (integers >= 0), got {list(self.allowed_token_ids)!r}")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-empty strings, got {list(self.bad_words)!r}")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutputParams):
                raise ValueError("structured_output must be a StructuredOutputParams")
            self.structured_output.kind()

    def token_ids_in_use(self) -> list[int]:
        """Every token id the request names (logit_bias keys, allowed ids, stop ids): checked against the vocab."""
        return [*(self.logit_bias or {}), *(self.allowed_token_ids or ()), *self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def uses_penalties(self) -> bool:
        """Presence / frequency / repetition penalties: per-request token counts on the device."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def uses_logits_state(self) -> bool:
        """Whether the request needs a row of device state (counts, prompt mask, bias) before sampling."""
        return (self.uses_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words))
