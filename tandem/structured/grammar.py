"""Grammars from structured-output specs: validation (no tokenizer, for a quick 400) and a compile cache that
compiles each distinct spec once, on a worker thread, off the engine's step."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tandem.sampling_params import StructuredOutputParams


def _xgr():  # type: ignore[no-untyped-def]
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a missing optional wheel
        raise ValueError("structured output needs the xgrammar package (pip install xgrammar)") from exc
    return xgrammar


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """`root ::= "a" | "b"`: JSON string escapes are valid EBNF string escapes."""
    if not choices:
        raise ValueError("guided_choice must list at least one string")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def to_grammar(spec: StructuredOutputParams) -> Any:
    """The xgrammar Grammar of a spec; ValueError with the compiler's message when it does not compile."""
    xgr = _xgr()
    kind = spec.kind()
    try:
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice or ()))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except ValueError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError / its own errors for a spec it cannot parse
        label = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "EBNF grammar"}.get(kind, kind)
        raise ValueError(f"the {label} does not compile: {exc}") from exc


def validate(spec: StructuredOutputParams) -> None:
    """Raises ValueError naming the problem if the spec would not compile."""
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, (dict, bool)):
            raise ValueError("the JSON schema must be an object")
    to_grammar(spec)


def synthetic_vocab(vocab_size: int, seed: int = 0) -> list[bytes]:
    """A BPE-like stand-in vocabulary: the 95 printable ASCII characters, then seeded strings of 2 to 8 of them
    (unique), so that grammar masks cost about what they cost with a real tokenizer of that size."""
    import random

    rng = random.Random(seed)
    chars = [chr(c) for c in range(32, 127)]
    vocab = list(chars)
    seen = set(vocab)
    while len(vocab) < vocab_size:
        word = "".join(rng.choices(chars, k=rng.randint(2, 8)))
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    return [w.encode() for w in vocab[:vocab_size]]


MAX_CACHED_GRAMMARS = 512


class GrammarCache:
    """Compiled grammars for one tokenizer, one per distinct spec; compiled on a worker thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_workers: int = 1) -> None:
        _xgr()  # fail now, in the caller, if xgrammar is missing
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.max_workers = max_workers
        self.compiler: Any = None  # built on the worker thread by the first compile (a second or so)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._futures: dict[tuple[str, str], Future] = {}  # insertion order: the oldest spec first

    def _compiler(self) -> Any:
        with self._build_lock:
            if self.compiler is None:
                xgr = _xgr()
                if self.tokenizer is None:  # random-weight benchmark shapes: a synthetic vocabulary
                    info = xgr.TokenizerInfo(synthetic_vocab(self.vocab_size), vocab_type=xgr.VocabType.RAW,
                                             vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                else:
                    info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                              stop_token_ids=self.stop_token_ids)
                self.compiler = xgr.GrammarCompiler(info, max_threads=self.max_workers, cache_enabled=False)
            return self.compiler

    def submit(self, spec: StructuredOutputParams) -> Future:
        """A future of the compiled grammar (done at once for a spec compiled before)."""
        key = spec.key()
        with self._lock:
            future = self._futures.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, spec)
                self._futures[key] = future
                if len(self._futures) > MAX_CACHED_GRAMMARS:  # forget the oldest compiled spec
                    oldest = next((k for k, f in self._futures.items() if f.done()), None)
                    if oldest is not None:
                        del self._futures[oldest]
        return future

    def _compile(self, spec: StructuredOutputParams) -> Any:
        return self._compiler().compile_grammar(to_grammar(spec))

    def __len__(self) -> int:
        return len(self._futures)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
