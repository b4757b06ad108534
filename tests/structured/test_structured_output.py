"""Structured output offline: every output under a JSON schema validates, overlap keeps the tokens, bad specs
are ValueErrors, and an aborted constrained request frees its grammar state and KV blocks."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.sampling_params import SamplingParams, StructuredOutputParams
from tests.structured.schemas import SCHEMAS


def _prompt(schema: dict) -> str:
    return f"Answer with JSON matching this schema: {json.dumps(schema)}\n"


def _run(llm, schemas: list[dict], temperature: float, overlap: bool = True, max_tokens: int = 96):
    llm.engine.overlap = overlap
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens,
                             structured_output=StructuredOutputParams(json=json.dumps(s)))
              for i, s in enumerate(schemas)]
    return llm.generate([_prompt(s) for s in schemas], params, use_tqdm=False)


def _check_valid(schemas: list[dict], outs) -> None:
    for schema, out in zip(schemas, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ten_schemas_always_validate(idle_llm, temperature):
    schemas = SCHEMAS[:10]
    _check_valid(schemas, _run(idle_llm, schemas, temperature))
    assert idle_llm.engine.num_host_masks() == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_always_validates(idle_llm, temperature):
    """All 52 schemas in one batch (about 10 s per temperature on 2 CPU cores)."""
    _check_valid(SCHEMAS, _run(idle_llm, SCHEMAS, temperature))


def test_constrained_greedy_tokens_are_the_same_with_overlap_on_and_off(idle_llm):
    schemas = SCHEMAS[10:16]
    on = [list(o.outputs[0].token_ids) for o in _run(idle_llm, schemas, 0.0, overlap=True)]
    off = [list(o.outputs[0].token_ids) for o in _run(idle_llm, schemas, 0.0, overlap=False)]
    assert on == off


@pytest.mark.parametrize("overlap", [True, False])
def test_grammar_rows_are_filled_right_before_the_next_forward(idle_llm, monkeypatch, overlap):
    """Forced drafts off: with overlap, step N's rows are filled on a worker thread after N - 1's tokens reached the
    matchers, while the caller takes the outputs and step N+1 is scheduled and written to its host buffers; N's
    sampling and N+1's forward then reach the GPU back to back. Without overlap, each step's rows come right after
    its own forward, on the engine's thread."""
    import threading

    runner = idle_llm.engine.runner
    calls: list[str] = []
    fill_threads: list[str] = []
    for name in ("prepare", "enqueue", "launch_sampling", "wait", "fill_masks"):
        original = getattr(runner, name)

        def wrapped(*args, _f=original, _n=name):  # type: ignore[no-untyped-def]
            if _n == "fill_masks":
                fill_threads.append(threading.current_thread().name)
            calls.append(_n)
            return _f(*args)

        monkeypatch.setattr(runner, name, wrapped)
    # Plain constrained steps (forced drafts, off by default, collect each step before the next: test_forced_drafts.py).
    assert idle_llm.engine.forced_k == 0
    outs = _run(idle_llm, SCHEMAS[:2], 0.0, overlap=overlap, max_tokens=12)
    assert all(o.outputs[0].token_ids for o in outs)
    main = threading.current_thread().name
    assert fill_threads and all((t != main) == overlap for t in fill_threads), fill_threads
    fills = [i for i, c in enumerate(calls) if c == "launch_sampling"]
    assert len(fills) >= 8 and calls.count("fill_masks") == len(fills)
    gpu_calls = [c for c in calls if c != "fill_masks"]  # the engine thread's order (the worker's interleaves)
    fills = [i for i, c in enumerate(gpu_calls) if c == "launch_sampling"]
    last_prepare = max(i for i, c in enumerate(gpu_calls) if c == "prepare")
    for i in fills:
        around = (i, gpu_calls[i - 3:i + 3])
        if not overlap:
            assert gpu_calls[i - 1] == "enqueue" and gpu_calls[i + 1] == "wait", around
        elif gpu_calls[i - 1] == "prepare":  # a next step: written before the fill, enqueued right after it
            assert gpu_calls[i + 1] == "enqueue", around
        else:  # the run's last steps: nothing left to schedule, so the fill follows the previous step's wait
            assert gpu_calls[i - 1] == "wait" and i > last_prepare, around
    if overlap:
        assert sum(gpu_calls[i - 1] == "prepare" for i in fills) >= len(fills) - 2


def test_mixed_batch_keeps_unconstrained_rows_unchanged(idle_llm):
    prompts = ["The capital of France is", "Give me a JSON object:"]
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = idle_llm.generate(prompts[:1], plain, use_tqdm=False)[0].outputs[0].token_ids
    json_obj = SamplingParams(temperature=0.0, max_tokens=48,
                              structured_output=StructuredOutputParams(json_object=True))
    outs = idle_llm.generate(prompts, [plain, json_obj], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    if outs[1].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[1].outputs[0].text), dict)
    else:
        assert outs[1].outputs[0].text.lstrip().startswith("{")


SPEC_CHECKS = [
    (StructuredOutputParams(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-"),
    (StructuredOutputParams(choice=("yes", "no", "maybe")), lambda t: t in ("yes", "no", "maybe")),
    (StructuredOutputParams(grammar='root ::= "(" [a-c]+ ")"'), lambda t: t[0] == "(" and t[-1] == ")"),
]
BAD_SPECS = [
    (StructuredOutputParams(json='{"type": "object", "properties": '), "not valid JSON"),
    (StructuredOutputParams(regex="([a-z"), "regex"),
    (StructuredOutputParams(grammar="root ::= undefined_rule"), "grammar"),
]


def check_spec(llm, spec: StructuredOutputParams, check) -> None:
    out = llm.generate(["Say something:"], SamplingParams(temperature=1.0, seed=3, max_tokens=24,
                                                           structured_output=spec), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop" and check(text), text


def check_bad_spec(llm, spec: StructuredOutputParams, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_output=spec), use_tqdm=False)
    assert llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("spec, check", SPEC_CHECKS)
def test_regex_choice_and_grammar(idle_llm, spec, check):
    check_spec(idle_llm, spec, check)


@pytest.mark.parametrize("spec, word",
                         [*BAD_SPECS, (StructuredOutputParams(json='{"type": "nonsense"}'), "JSON schema")])
def test_bad_specs_are_value_errors_and_the_engine_keeps_serving(idle_llm, spec, word):
    check_bad_spec(idle_llm, spec, word)


def test_two_constraints_at_once_are_rejected():
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_output=StructuredOutputParams(json="{}", regex="a"))


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_mid_generation_frees_grammar_state_and_blocks(idle_llm, overlap):
    engine = idle_llm.engine
    engine.overlap = overlap
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=200, structured_output=StructuredOutputParams(
        json=json.dumps({"type": "array", "items": {"type": "integer"}})))
    engine.add_request("abort-me", idle_llm.tokenizer.encode("Numbers:"), params)
    got = 0
    for _ in range(50):
        got += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == "abort-me")
        if got >= 4:
            break
    assert engine.num_host_masks() == 1
    engine.abort_request("abort-me")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_host_masks() == 0


def test_multi_token_bad_words_never_appear(idle_llm):
    prompt = "Write about the history of the United States of America:"
    plain = idle_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    words = plain.outputs[0].text.split()
    phrase = " ".join(words[1:3])  # two words of the greedy answer: several tokens
    assert phrase and phrase in plain.outputs[0].text
    banned = SamplingParams(temperature=0.0, max_tokens=24, bad_words=[phrase])
    text = idle_llm.generate([prompt], banned, use_tqdm=False)[0].outputs[0].text
    assert phrase not in text
    assert idle_llm.engine.num_host_masks() == 0
