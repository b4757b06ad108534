"""Grammars from structured-output specs: validation (no tokenizer, for a quick 400) and a compile cache that
compiles each distinct spec once, on a worker thread, off the engine's step.

Two backends, chosen by --grammar-backend (EngineConfig.grammar_backend) or else per process by
TANDEM_STRUCTURED_BACKEND (the server's API and engine processes inherit it): llguidance (the default) or
xgrammar. Both fill the same int32 bitmask rows. llguidance computes a mask in tens of microseconds where
xgrammar can take milliseconds (a string bounded by maxLength checks every token one by one): with half of 64
requests under a JSON schema it kept 0.945 of the unconstrained tokens/s on an H200, xgrammar 0.620. Ranged JSON
numbers get at most 6 digits after the point under both, so a model cannot write "1.000..." until max_tokens, and
a JSON schema's objects generate only the properties they name unless the schema says otherwise
(strict_json_schema; structured/json_schema.py)."""

from __future__ import annotations

import copy
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tandem.config import GRAMMAR_BACKENDS
from tandem.sampling_params import StructuredOutputParams
from tandem.structured.json_schema import prepare_json_schema

BACKENDS = GRAMMAR_BACKENDS
DEFAULT_BACKEND = "llguidance"


def backend() -> str:
    """The structured-output backend of this process (TANDEM_STRUCTURED_BACKEND; default llguidance)."""
    name = os.environ.get("TANDEM_STRUCTURED_BACKEND", DEFAULT_BACKEND)
    if name not in BACKENDS:
        raise ValueError(f"TANDEM_STRUCTURED_BACKEND must be one of {BACKENDS}, got {name!r}")
    return name


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


def _llg():  # type: ignore[no-untyped-def]
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a missing optional wheel
        raise ValueError("structured output needs the llguidance package (pip install llguidance)") from exc
    return llguidance


# Compact JSON with a space after ',' and ':' (json.dumps' own layout): no free whitespace for a model to fill.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_LABEL = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


def choice_lark(choices: tuple[str, ...]) -> str:
    """`start: "a" | "b"`: JSON string escapes are valid Lark string escapes."""
    if not choices:
        raise ValueError("guided_choice must list at least one string")
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _llg_grammar(spec: StructuredOutputParams, strict: bool = True) -> str:
    """The llguidance grammar of a spec (checked); ValueError with the compiler's message when it does not compile.
    `strict`: a JSON schema's objects generate only the properties they name (json_schema.prepare_json_schema).

    A `grammar` in GBNF (rules written `name ::= ...`, the start rule `root`) is converted to Lark; any other
    text is taken as Lark (start rule `start`)."""
    llg = _llg()
    kind = spec.kind()
    try:
        if kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(
                prepare_json_schema(spec.json or "", strict, bound_digits=True), defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec.regex)
        elif kind == "choice":
            grammar = llg.LLMatcher.grammar_from_lark(choice_lark(spec.choice or ()))
        else:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = spec.grammar or ""
            grammar = llg.LLMatcher.grammar_from_lark(gbnf_to_lark(text) if "::=" in text else text)
    except Exception as exc:  # ValueError from llguidance, the GBNF converter's own errors for text it cannot parse
        raise ValueError(f"the {_LABEL.get(kind, kind)} does not compile: {exc}") from exc
    error = llg.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"the {_LABEL.get(kind, kind)} does not compile: {error}")
    return grammar


def _xgr_grammar(spec: StructuredOutputParams, strict: bool = True) -> Any:
    """The xgrammar Grammar of a spec; ValueError with the compiler's message when it does not compile. The strict
    reading is tandem's own (json_schema.prepare_json_schema), the same for both backends: xgrammar's strict_mode
    would also close objects that name no properties at all."""
    xgr = _xgr()
    kind = spec.kind()
    try:
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "json":
            return xgr.Grammar.from_json_schema(prepare_json_schema(spec.json or "", strict, bound_digits=False),
                                                any_whitespace=False, strict_mode=False)
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


def to_grammar(spec: StructuredOutputParams, backend_name: str | None = None, strict: bool = True) -> Any:
    """The spec's grammar for a backend (default: this process's): an xgrammar Grammar or an llguidance string."""
    if (backend_name or backend()) == "xgrammar":
        return _xgr_grammar(spec, strict)
    return _llg_grammar(spec, strict)


def validate(spec: StructuredOutputParams, backend_name: str | None = None) -> None:
    """Raises ValueError naming the problem if the spec would not compile."""
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, (dict, bool)):
            raise ValueError("the JSON schema must be an object")
    to_grammar(spec, backend_name)


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


class _SyntheticTokenizer:
    """What llguidance needs of a tokenizer, over synthetic_vocab (random-weight shapes have no tokenizer): the
    token strings, the stop tokens (the last ids), and an encoder (character by character)."""

    def __init__(self, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokens = synthetic_vocab(vocab_size)
        self.eos_token_id = stop_token_ids[0] if stop_token_ids else vocab_size - 1
        self.bos_token_id = None
        self.special_token_ids = list(stop_token_ids)
        for t in self.special_token_ids:
            self.tokens[t] = b""

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        return [b - 32 for b in data if 32 <= b < 127]


def llguidance_tokenizer_json(tokenizer: Any) -> str:
    """The tokenizer's serialized form (tokenizer.json) for llguidance, which reads each token's bytes from it and
    tells a byte-level BPE vocabulary ("Ġ" for a space) by its decoder. Some transformers versions convert a GGUF
    byte-level vocabulary with a decoder chain (ByteFallback, Fuse, Replace, ByteLevel) that llguidance does not
    recognise: it would take "Ġ" for two bytes of text, and its masks would allow tokens its matcher then refuses.
    Such a chain is reduced to its ByteLevel step, which decodes these tokens the same way."""
    backend_tokenizer = copy.copy(tokenizer.backend_tokenizer)
    backend_tokenizer.no_padding()
    backend_tokenizer.no_truncation()
    data = json.loads(backend_tokenizer.to_str())
    decoder = data.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if byte_level:
            data["decoder"] = byte_level[0]
    return json.dumps(data)


MAX_CACHED_GRAMMARS = 512


@dataclass(slots=True)
class LLGuidanceStarts:
    """A compiled llguidance grammar as requests start from it: matchers in the start state ("lineages"), each built
    from the grammar on its own; a request advances a copy of one. The copies of one matcher share its lexer state
    behind one lock, so a step's rows, filled on several threads, wait for each other when they all descend from
    one matcher: requests take the lineages in turn. On 2 cores, 48 rows of the structured workload's schema filled
    in 12.3 ms on one thread; on two, 16.6 ms as copies of one matcher and 8.8 ms as separately built ones. The
    first lineage is built by the compile and the others (pipeline.grammar_lineages in all, ~1.4 ms each) by a
    background thread: a grammar's first request waits for none of them, and a burst of requests sharing it is
    admitted as they come (the i-th request waits for lineage i mod target)."""

    starts: list[Any]
    target: int = 1  # lineages wanted; lowered to those built if building one fails
    turn: int = 0

    def has_next(self) -> bool:
        """Whether the lineage the next request takes is built."""
        return self.turn % self.target < len(self.starts)

    def next_start(self) -> Any:
        """The start matcher the next request copies (round robin over the lineages built)."""
        start = self.starts[self.turn % self.target % len(self.starts)]
        self.turn += 1
        return start


class GrammarCache:
    """Compiled grammars for one tokenizer, one per distinct spec; compiled on a worker thread. xgrammar: a
    CompiledGrammar; llguidance: a matcher in its start state, which each request copies."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_workers: int = 1,
                 backend_name: str | None = None, strict_json_schema: bool = True, lineages: int = 1) -> None:
        self.backend = backend_name or backend()
        if self.backend not in BACKENDS:
            raise ValueError(f"structured-output backend must be one of {BACKENDS}, got {self.backend!r}")
        _xgr() if self.backend == "xgrammar" else _llg()  # fail now, in the caller, if the package is missing
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.max_workers = max_workers
        self.strict_json_schema = strict_json_schema  # the reading of a JSON schema's unnamed properties
        self.lineages = max(1, lineages)  # llguidance: start matchers built per grammar (LLGuidanceStarts)
        self.compiler: Any = None  # built on the worker thread by the first compile (a second or so)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        # llguidance lineages past a grammar's first, behind every compile: one thread, so they never delay one.
        self._lineage_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-lineages")
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._futures: dict[tuple[str, str], Future] = {}  # insertion order: the oldest spec first

    def _compiler(self) -> Any:
        """xgrammar: its GrammarCompiler; llguidance: its LLTokenizer."""
        with self._build_lock:
            if self.compiler is None:
                self.compiler = self._build_xgr() if self.backend == "xgrammar" else self._build_llg()
            return self.compiler

    def _build_xgr(self) -> Any:
        xgr = _xgr()
        if self.tokenizer is None:  # random-weight benchmark shapes: a synthetic vocabulary
            info = xgr.TokenizerInfo(synthetic_vocab(self.vocab_size), vocab_type=xgr.VocabType.RAW,
                                     vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        else:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
        return xgr.GrammarCompiler(info, max_threads=self.max_workers, cache_enabled=False)

    def _build_llg(self) -> Any:
        llg = _llg()
        if self.tokenizer is None:
            return llg.LLTokenizer(llg.TokenizerWrapper(_SyntheticTokenizer(self.vocab_size, self.stop_token_ids)))
        return llg.LLTokenizer(llguidance_tokenizer_json(self.tokenizer), n_vocab=self.vocab_size,
                               eos_token=list(self.stop_token_ids) or None)

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
        if self.backend == "xgrammar":
            return self._compiler().compile_grammar(_xgr_grammar(spec, self.strict_json_schema))
        grammar = _llg_grammar(spec, self.strict_json_schema)
        matcher = self._start_matcher(grammar)
        if matcher.is_error():
            raise ValueError(f"the {_LABEL.get(spec.kind(), spec.kind())} does not compile: {matcher.get_error()}")
        starts = LLGuidanceStarts([matcher], target=self.lineages)
        if self.lineages > 1:
            # Ended (built, failed or cancelled by shutdown): requests share the lineages that were built.
            self._lineage_pool.submit(self._add_lineages, starts, grammar).add_done_callback(
                lambda _: setattr(starts, "target", len(starts.starts)))
        return starts

    def _start_matcher(self, grammar: str) -> Any:
        """A matcher built from the grammar (~1 ms for a JSON schema), its start state's mask computed once here:
        the lexer states that builds are shared with every copy, so a request's first mask does not build them on
        the step (computing a mask leaves the state)."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        matcher = _llg().LLMatcher(self._compiler(), grammar)
        if not matcher.is_error():
            fill_next_token_bitmask(matcher, allocate_token_bitmask(1, self.vocab_size))
        return matcher

    def _add_lineages(self, starts: LLGuidanceStarts, grammar: str) -> None:
        """Appends the grammar's other lineages, up to the first that cannot be built."""
        while len(starts.starts) < starts.target:
            matcher = self._start_matcher(grammar)
            if matcher.is_error():
                return
            starts.starts.append(matcher)

    def __len__(self) -> int:
        return len(self._futures)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lineage_pool.shutdown(wait=False, cancel_futures=True)
