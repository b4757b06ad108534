"""End-to-end generation on the embedded SmolLM2 GGUF, checked against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tests.chat_prompts import MAX_TOKENS, QUESTIONS, chat_messages, stop_ids, until_stop

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the ocean and the moon, in the style of a sailor's song:",
    "1, 2, 3, 4,",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter who",
    "Translate to French: Good morning, how are you today?",
    "Hi",
    "The three primary colors are",
]


def hf_greedy_picks(hf_model, prompt_ids: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy pick after the prompt and each prefix of `tokens`, from one teacher-forced forward: equal
    to `tokens` exactly when they are transformers' greedy continuation (a greedy sequence is its own argmax at
    every step), and 16 prompts cost 16 forwards instead of 16 x 32 decode steps of generate()."""
    ids = prompt_ids + tokens
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1 : len(ids) - 1]
    return logits.argmax(-1).tolist()


def hf_stop_ids(hf_model) -> set[int]:
    """The tokens transformers' generate() stops after."""
    eos = hf_model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def assert_transformers_greedy(hf_model, prompt_ids: list[int], got: list[int], max_new_tokens: int, label: str,
                               stops: set[int] | None = None) -> None:
    """`got` is what transformers' greedy generate(max_new_tokens) returns (cut after the first of `stops` when
    given): its argmax at every step, ended where generate() ends (a stop token, else max_new_tokens)."""
    expected = hf_greedy_picks(hf_model, prompt_ids, got)
    assert got == expected, f"{label}: tandem {got} != transformers' greedy picks {expected}"
    hf_stops = hf_stop_ids(hf_model)
    ends = hf_stops | (stops or set())
    assert not hf_stops & set(got[:-1]), f"{label}: transformers would stop before tandem's end: {got}"
    assert len(got) == max_new_tokens or (got and got[-1] in ends), \
        f"{label}: tandem stopped at {len(got)} tokens where transformers goes on: {got}"


def test_greedy_matches_transformers_under_continuous_batching(idle_llm, hf_model):
    tok = idle_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=32)
    outputs = idle_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        got = out.outputs[0].token_ids
        assert_transformers_greedy(hf_model, ids, list(got), 32, repr(prompt))
        assert out.outputs[0].text == tok.decode(got, skip_special_tokens=True)
        assert out.outputs[0].finish_reason in ("stop", "length")


def test_chat_greedy_text_matches_transformers(idle_llm, hf_model):
    """The 16 chat prompts of the GPU real-weights test: tandem's fp32 greedy text equals transformers' up to
    the first stop token (the GPU test then holds tandem's GPU run to this CPU run)."""
    stops = stop_ids(idle_llm.get_tokenizer())
    outputs = idle_llm.chat([chat_messages(q) for q in QUESTIONS],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for question, out in zip(QUESTIONS, outputs):
        got = until_stop(list(out.outputs[0].token_ids), stops)
        assert_transformers_greedy(hf_model, out.prompt_token_ids, got, MAX_TOKENS, repr(question), stops)


def test_overlap_and_sync_give_identical_tokens(idle_llm):
    engine = idle_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.overlap = True
    overlap = [o.outputs[0].token_ids for o in idle_llm.generate(PROMPTS, params, use_tqdm=False)]
    engine.overlap = False
    sync = [o.outputs[0].token_ids for o in idle_llm.generate(PROMPTS, params, use_tqdm=False)]
    assert overlap == sync
    assert all(len(t) == 24 for t in overlap)


def test_seeded_sampling_is_reproducible_and_batch_independent(idle_llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    alone = idle_llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = idle_llm.generate(PROMPTS[:5], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched
    other = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=99, ignore_eos=True)
    assert idle_llm.generate(PROMPTS[0], other, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(idle_llm):
    greedy = idle_llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
    topk1 = idle_llm.generate(PROMPTS[:3], SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_logprobs_are_log_softmax_of_the_model(idle_llm, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)
    out = idle_llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 3
    with torch.no_grad():
        logits = hf_model(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    first = comp.logprobs[0]
    assert comp.token_ids[0] in first and len(first) >= 5
    for token_id, lp in first.items():
        assert abs(lp - ref[token_id].item()) < 1e-3
    top5 = set(ref.topk(5).indices.tolist())
    assert top5 <= set(first)
    assert comp.cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(comp.logprobs, comp.token_ids)))


def test_stop_strings_and_stop_token_ids(idle_llm):
    tok = idle_llm.get_tokenizer()
    base = idle_llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert "7" in base.text
    stopped = idle_llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=20, stop=["7"]),
                                use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "7"
    assert stopped.text == base.text[: base.text.index("7")]
    stop_id = base.token_ids[3]
    by_id = idle_llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id],
                                                            ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert tok is not None


def test_n_completions_and_chat(idle_llm):
    out = idle_llm.generate("Tell me a joke.", SamplingParams(temperature=1.0, n=3, max_tokens=8, seed=7,
                                                             ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    chat = idle_llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0.0, max_tokens=16),
                         use_tqdm=False)[0]
    assert "<|im_start|>assistant" in chat.prompt
    assert chat.outputs[0].text


def test_generate_steps_with_the_relaxed_collector_and_restores_it(idle_llm, monkeypatch):
    import gc

    from tandem.config import GC_GEN0_THRESHOLD

    engine = idle_llm.engine
    seen: list[int] = []
    real_step = engine.step

    def step():  # type: ignore[no-untyped-def]
        seen.append(gc.get_threshold()[0])
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    before = gc.get_threshold()
    idle_llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert seen and set(seen) == {GC_GEN0_THRESHOLD}
    assert gc.get_threshold() == before
