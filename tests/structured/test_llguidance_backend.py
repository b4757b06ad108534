"""The llguidance backend (grammar_backend="llguidance", or TANDEM_STRUCTURED_BACKEND=llguidance) behind the same
engine: JSON schemas, regex, choice and GBNF grammars constrain the embedded model's output, bad specs are
ValueErrors naming the field, overlap keeps the tokens, a grammar's rows fill the same bitmask layout as
xgrammar's, and a byte-level vocabulary is read right whatever decoder chain the tokenizer carries."""

from __future__ import annotations

import argparse
import copy
import json
import time

import jsonschema
import numpy as np
import pytest
import torch

from tandem import LLM
from tandem.sampling_params import SamplingParams, StructuredOutputParams
from tandem.structured.grammar import GrammarCache
from tandem.structured.matcher import HostMask
from tests.structured.schemas import SCHEMAS
from tests.structured.test_structured_output import BAD_SPECS, SPEC_CHECKS, check_bad_spec, check_spec

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def guided_llm():
    llm = LLM(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=16, num_kv_blocks=256, seed=0,
              grammar_backend="llguidance")
    yield llm
    llm.shutdown()


def _json(llm, schemas, temperature, overlap=True):
    llm.engine.overlap = overlap
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=96,
                             structured_output=StructuredOutputParams(json=json.dumps(s)))
              for i, s in enumerate(schemas)]
    prompts = [f"Answer with JSON matching this schema: {json.dumps(s)}\n" for s in schemas]
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schemas_validate(guided_llm, temperature):
    schemas = SCHEMAS[:10]
    for schema, out in zip(schemas, _json(guided_llm, schemas, temperature)):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert guided_llm.engine.num_host_masks() == 0


def test_overlap_keeps_the_constrained_greedy_tokens(guided_llm):
    schemas = SCHEMAS[20:24]
    on = [o.outputs[0].token_ids for o in _json(guided_llm, schemas, 0.0, overlap=True)]
    off = [o.outputs[0].token_ids for o in _json(guided_llm, schemas, 0.0, overlap=False)]
    assert on == off


@pytest.mark.parametrize("spec, check", SPEC_CHECKS + [
    (StructuredOutputParams(choice=("yes", 'say "no"')), lambda t: t in ("yes", 'say "no"')),
    (StructuredOutputParams(grammar='start: "<" /[xy]+/ ">"'), lambda t: t[0] == "<" and set(t[1:-1]) <= {"x", "y"}),
])
def test_regex_choice_gbnf_and_lark(guided_llm, spec, check):
    check_spec(guided_llm, spec, check)


@pytest.mark.parametrize("spec, word", BAD_SPECS)
def test_bad_specs_are_value_errors(guided_llm, spec, word):
    check_bad_spec(guided_llm, spec, word)


def test_both_backends_fill_the_same_bitmask(monkeypatch):
    # A regex over a synthetic vocabulary: the two backends must allow exactly the same tokens at every step.
    spec = StructuredOutputParams(regex=r"[a-c]{2}x?")
    rows = {}
    for backend in ("xgrammar", "llguidance"):
        monkeypatch.setenv("TANDEM_STRUCTURED_BACKEND", backend)
        cache = GrammarCache(None, 300, [299])
        mask = HostMask(cache.submit(spec).result())
        bits = torch.zeros(1, (300 + 31) // 32, dtype=torch.int32)
        seen = []
        for token in (ord("a") - 32, ord("c") - 32):  # the synthetic vocabulary starts with the printable ASCII
            HostMask.fill_rows(bits, [(0, mask, [])])
            seen.append(bits.clone())
            mask.accept(token)
        HostMask.fill_rows(bits, [(0, mask, [])])
        seen.append(bits.clone())
        rows[backend] = seen
        cache.shutdown()
    for a, b in zip(rows["xgrammar"], rows["llguidance"]):
        assert torch.equal(a, b)


def test_requests_take_the_start_matchers_in_turn_and_fill_the_same_rows():
    """A grammar compiles into one start matcher per lineage (copies of one matcher share its lock, so a step's rows
    come from several); requests take them in turn, and whichever a row descends from, it allows the same tokens."""
    from tandem.structured.grammar import LLGuidanceStarts

    spec = StructuredOutputParams(json=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                   "required": ["a"]}))
    cache = GrammarCache(None, 300, [299], backend_name="llguidance", lineages=3)
    compiled = cache.submit(spec).result()
    assert isinstance(compiled, LLGuidanceStarts) and len(compiled.starts) >= 1  # the others come in the background
    deadline = time.monotonic() + 30
    while len(compiled.starts) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len({id(m) for m in compiled.starts}) == 3 and compiled.target == 3
    masks = [HostMask(compiled) for _ in range(4)]
    assert compiled.turn == 4  # lineages 0, 1, 2, 0
    bits = torch.zeros(4, (300 + 31) // 32, dtype=torch.int32)
    for char in '{"a": 1':
        HostMask.fill_rows(bits, [(i, m, []) for i, m in enumerate(masks)])
        assert all(torch.equal(bits[0], bits[i]) for i in range(1, 4))
        assert bits[0].any()
        for m in masks:
            assert m.accept(ord(char) - 32)
    cache.shutdown()


def test_a_burst_sharing_a_grammar_is_admitted_as_its_lineages_are_built(monkeypatch):
    """The i-th request of a grammar takes lineage i mod N, and waits in admission until that one is built: every
    request is admitted, in order, each lineage taken by as many requests as the others."""
    from tandem.request import Request
    from tandem.structured.grammar import LLGuidanceStarts
    from tandem.structured.pipeline import GrammarPipeline

    taken: list[int] = []
    next_start = LLGuidanceStarts.next_start

    def recording(self):  # type: ignore[no-untyped-def]
        start = next_start(self)
        taken.append(id(start))
        return start

    monkeypatch.setattr(LLGuidanceStarts, "next_start", recording)

    spec = StructuredOutputParams(json=json.dumps({"type": "object", "properties": {"b": {"type": "string"}}}))
    pipeline = GrammarPipeline(None, 300, [299], "llguidance")
    pipeline._cache = GrammarCache(None, 300, [299], backend_name="llguidance", lineages=4)
    requests = [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=4), frozenset(), 64, 0) for i in range(8)]
    for request in requests:
        pipeline.submit(request, spec)
    admitted: list[Request] = []
    deadline = time.monotonic() + 30
    while len(admitted) < 8 and time.monotonic() < deadline:
        assert not pipeline.admit(admitted.append, block=True)
    assert admitted == requests
    compiled = pipeline._cache.submit(spec).result()
    assert isinstance(compiled, LLGuidanceStarts) and len(compiled.starts) == 4
    assert taken == [id(m) for m in compiled.starts] * 2
    pipeline._cache.shutdown()


def test_grammar_lineages_setting(monkeypatch):
    from tandem.structured.pipeline import grammar_lineages

    monkeypatch.delenv("TANDEM_GRAMMAR_LINEAGES", raising=False)
    monkeypatch.setenv("TANDEM_MASK_THREADS", "3")
    assert grammar_lineages() == 3  # one per mask thread
    monkeypatch.setenv("TANDEM_GRAMMAR_LINEAGES", "16")
    assert grammar_lineages() == 16
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("TANDEM_GRAMMAR_LINEAGES", bad)
        with pytest.raises(ValueError, match="TANDEM_GRAMMAR_LINEAGES must be a positive integer"):
            grammar_lineages()


def test_the_engine_switches_backend_between_runs(guided_llm):
    engine = guided_llm.engine
    assert engine.structured_backend == "llguidance"
    with pytest.raises(ValueError, match="backend must be one of"):
        engine.use_structured_backend("outlines")
    schemas = SCHEMAS[:2]
    engine.use_structured_backend("xgrammar")
    try:
        for schema, out in zip(schemas, _json(guided_llm, schemas, 0.0)):
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert engine.grammar.cache is not None and engine.grammar.cache.backend == "xgrammar"
    finally:
        engine.use_structured_backend("llguidance")


def test_byte_level_vocabulary_behind_a_decoder_chain(guided_llm):
    # transformers 5.17 converts the embedded GGUF vocabulary with this decoder chain; llguidance must still read
    # "Ġ" as a space, or its masks allow tokens that its own matcher then refuses.
    from tokenizers import decoders

    tok = copy.deepcopy(guided_llm.engine.tokenizer)
    tok.backend_tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " "), decoders.ByteLevel()])
    space_quote = tok.convert_tokens_to_ids("Ġ\"")
    assert tok.decode([space_quote]) == ' "'
    vocab = guided_llm.engine.model_config.vocab_size
    cache = GrammarCache(tok, vocab, [tok.eos_token_id], backend_name="llguidance")
    assert cache._compiler().decode_bytes([space_quote]) == b' "'
    masks = [HostMask(cache.submit(StructuredOutputParams(json=json.dumps(s))).result()) for s in SCHEMAS[:12]]
    bits = torch.zeros(len(masks), (vocab + 31) // 32, dtype=torch.int32)
    rng = np.random.default_rng(0)
    for _ in range(12):  # random allowed tokens: every one must be accepted
        HostMask.fill_rows(bits, [(j, m, []) for j, m in enumerate(masks)])
        for j, m in enumerate(masks):
            words = bits[j].numpy().view(np.uint32)
            allowed = np.flatnonzero((words[:, None] >> np.arange(32, dtype=np.uint32)) & 1)
            assert m.accept(int(rng.choice(allowed)))
    cache.shutdown()


def test_grammar_backend_flag():
    from tandem.config import EngineConfig
    from tandem.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--grammar-backend", "llguidance"]))["grammar_backend"] == "llguidance"
    assert engine_kwargs(parser.parse_args([]))["grammar_backend"] is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--grammar-backend", "outlines"])
    with pytest.raises(ValueError, match="grammar_backend must be one of"):
        EngineConfig(grammar_backend="outlines")


def test_ranged_numbers_have_at_most_six_fraction_digits():
    # As under xgrammar: without the bound, a model can write "1.0000..." under `maximum: 1` until max_tokens.
    from tandem.structured.json_schema import bounded_number_digits

    schema = {"type": "object", "properties": {
        "enum": {"type": "number", "maximum": 1},  # a property named like a keyword is still a schema
        "free": {"type": "number"},  # no range: left alone (xgrammar does not bound it either)
        "step": {"type": "number", "minimum": 0, "multipleOf": 0.5},  # the user's own multipleOf stays
        "odd": {"type": "number", "minimum": 0.1234567}},  # a bound finer than the digits: left alone
        "enum": [{"type": "number", "maximum": 1}]}  # data, not a schema
    out = json.loads(bounded_number_digits(json.dumps(schema)))
    props = out["properties"]
    assert props["enum"]["multipleOf"] == 1e-6
    assert "multipleOf" not in props["free"] and "multipleOf" not in props["odd"]
    assert props["step"]["multipleOf"] == 0.5 and out["enum"] == schema["enum"]
    assert bounded_number_digits("{not json") == "{not json"
    cache = GrammarCache(None, 300, [299], backend_name="llguidance")
    spec = StructuredOutputParams(json=json.dumps({"type": "number", "minimum": 0, "maximum": 1}))
    for text, ended in (("0.123456", True), ("1.000000", True), ("0.5", False), ("0.12", False)):
        mask = HostMask(cache.submit(spec).result())
        assert all(mask.accept(ord(c) - 32) for c in text), text  # the synthetic vocabulary: ASCII first
        assert mask.is_terminated == ended, text  # six digits after the point: only the end may follow
    cache.shutdown()
