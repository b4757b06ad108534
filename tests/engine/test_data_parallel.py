"""LLM(data_parallel_size=2) on the CPU with a tiny random model and a character tokenizer (text in, text out, a
chat template): one engine's outputs, every request once, bad prompts refused at add_request while the others go on.
The replicas only step; this process tokenizes, detokenizes and checks stop strings, as with any model."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import pytest

from tandem import LLM, SamplingParams
from tests.parallel.tiny_models import save_tiny, save_tiny_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Once upon a time",
    "def fibonacci(n):",
]
# Greedy, a stop string (one the first prompt's greedy answer reaches: _stop_string), logprobs, and seeded sampling
# with n=2: each replica must give what one engine gives for all of them.
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=16),
    SamplingParams(temperature=0.0, max_tokens=14),
    SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True),  # all 10 (EOS came 2nd)
    SamplingParams(temperature=0.8, top_k=40, max_tokens=10, n=2, seed=123),
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=32, seed=0)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = save_tiny_tokenizer(save_tiny("llama", tmp_path_factory.mktemp("llama")))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def one_llm(tiny_model):
    """One engine: the reference."""
    llm = LLM(tiny_model, num_kv_blocks=128, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def dp_llm(tiny_model):
    # The reference's settings over two replicas with 64 KV blocks each.
    llm = LLM(tiny_model, num_kv_blocks=64, data_parallel_size=2, **ENGINE)
    yield llm
    llm.shutdown()


def _stop_string(llm) -> str:
    """A character the first prompt's greedy answer (under PARAMS[0]) has after its first: a stop string it reaches
    before max_tokens."""
    text = llm.generate(PROMPTS[:1], PARAMS[0], use_tqdm=False)[0].outputs[0].text
    stop = next((c for c in text[1:] if c.strip()), None)
    assert stop is not None, f"no stop string in {text!r}"
    return stop


def _completions(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def test_dp2_outputs_equal_one_engine_in_order(dp_llm, one_llm):
    routed: list[int] = []
    router = dp_llm.engine.router
    pick = router.pick

    def spy(prompt_token_ids: list[int], max_new_tokens: int | None = None) -> int:
        routed.append(pick(prompt_token_ids, max_new_tokens))
        return routed[-1]

    stop = _stop_string(one_llm)
    params = [replace(PARAMS[0], stop=[stop]), *PARAMS[1:]]
    router.pick = spy
    try:
        got = dp_llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        del router.pick
    expected = one_llm.generate(PROMPTS, params, use_tqdm=False)
    assert set(routed) == {0, 1}, "both replicas should get requests"
    assert [o.prompt for o in got] == PROMPTS
    ids = [int(o.request_id) for o in got]
    assert ids == sorted(ids) and len(set(ids)) == len(PROMPTS)
    assert _completions(got) == _completions(expected)
    assert [len(o.outputs) for o in got] == [p.n for p in PARAMS]
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].stop_reason == stop
    for a, b in zip(got[2].outputs[0].logprobs, expected[2].outputs[0].logprobs):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
    assert len(got[2].outputs[0].logprobs) == len(got[2].outputs[0].token_ids)
    chat = [{"role": "user", "content": "What is 2 plus 2?"}]
    assert _completions(dp_llm.chat(chat, GREEDY, use_tqdm=False)) == _completions(one_llm.chat(chat, GREEDY,
                                                                                                 use_tqdm=False))


def test_engine_returns_every_request_exactly_once(dp_llm):
    engine = dp_llm.engine
    tok = dp_llm.get_tokenizer()
    ids = [f"once-{i}" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i, rid in enumerate(ids):
        engine.add_request(rid, tok.encode(f"Item {i}: a short prompt"), params)
    assert {engine.replica_of(rid) for rid in ids} == {0, 1}
    finished: Counter[str] = Counter()
    tokens: dict[str, list[int]] = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            assert finished[out.request_id] == 0, f"{out.request_id} had output after it finished"
            tokens[out.request_id] += out.new_token_ids
            finished[out.request_id] += out.finished
    assert finished == Counter({rid: 1 for rid in ids})
    assert all(len(tokens[rid]) == 5 for rid in ids)
    assert engine.router.load == [0, 0]


def test_bad_prompts_fail_at_add_request_and_the_rest_goes_on(dp_llm, one_llm):
    engine = dp_llm.engine
    vocab = engine.vocab_size
    good = "The capital of France is"
    with pytest.raises(ValueError, match=r"not an integer in \[0, "):
        dp_llm.generate([good, [1, vocab + 5]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="context limit"):
        dp_llm.generate([good, [5] * engine.max_model_len], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="context limit"):
        dp_llm.generate([good], SamplingParams(max_tokens=engine.max_model_len), use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.router.load == [0, 0]

    # Straight on the engine: the refused requests leave the accepted one running.
    ids = dp_llm.get_tokenizer().encode(good)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("ok", ids, params)
    for bad_id, bad_prompt, match in (("empty", [], "empty"), ("oov", [vocab], "not an integer"),
                                      ("neg", [-1], "not an integer"), ("ok", ids, "already in use")):
        with pytest.raises(ValueError, match=match):
            engine.add_request(bad_id, bad_prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"ok"}
    assert sum(len(o.new_token_ids) for o in outputs) == 6 and outputs[-1].finished

    # Aborted requests' late outputs never reach a later call.
    assert _completions(dp_llm.generate([good], GREEDY, use_tqdm=False)) == _completions(
        one_llm.generate([good], GREEDY, use_tqdm=False))
    assert engine.router.load == [0, 0]
