"""Prompt logprobs and max_tokens=0 (scoring) on a tiny random Llama, checked against transformers in fp32."""

from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tandem.sampling_params import MAX_LOGPROBS
from tests.parallel.tiny_models import VOCAB, save_tiny

transformers = pytest.importorskip("transformers")

PROMPT_LENS = (37, 5, 1, 70, 2)
TOP_K = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


def make_llm(folder, **kwargs):
    from tandem import LLM

    args = dict(model=folder, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8, num_kv_blocks=128,
                block_size=16, seed=0)
    args.update(kwargs)
    return LLM(**args)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: row j is the log-softmax of position j's logits, which scores token j + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(out, hf, k: int) -> None:
    ids = out.prompt_token_ids
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    if len(ids) == 1:
        return
    ref = hf_prompt_logprobs(hf, ids)
    for j, entry in enumerate(plp[1:]):
        token = ids[j + 1]
        assert abs(entry[token] - float(ref[j, token])) < 1e-4, (j, entry[token], float(ref[j, token]))
        top_ref = ref[j].topk(k)
        expected = {int(t): float(v) for t, v in zip(top_ref.indices, top_ref.values)}
        assert set(entry) == set(expected) | {token}
        for t, v in expected.items():
            assert abs(entry[t] - v) < 1e-4


def ref_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_prompt_logprobs_match_transformers_chunked_and_batched(tiny, overlap, prefix_cache):
    """Chunked prefill (16-token steps), scoring requests batched with ordinary ones, a prompt seen before
    (a prefix cache hit for an ordinary request, bypassed by a scoring one)."""
    folder, hf = tiny
    llm = make_llm(folder, max_num_batched_tokens=16, enable_prefix_caching=prefix_cache, overlap=overlap)
    try:
        ps = prompts()
        # Warm the prefix cache with the longest prompt.
        llm.generate([ps[3]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        scoring = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=TOP_K)
        with_tokens = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)
        plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        batch = [ps[0], ps[3], ps[1], ps[2], ps[4], ps[3], ps[0]]
        params = [scoring, scoring, with_tokens, scoring, plain, plain, with_tokens]
        outs = llm.generate(batch, params, use_tqdm=False)
        for out, sp in zip(outs, params):
            c = out.outputs[0]
            if sp.prompt_logprobs is None:
                assert out.prompt_logprobs is None
                assert c.token_ids == ref_greedy(hf, out.prompt_token_ids, 6)
                continue
            check(out, hf, sp.prompt_logprobs)
            if sp.max_tokens == 0:
                assert c.token_ids == [] and c.text == "" and c.finish_reason == "length"
            else:
                assert c.token_ids == ref_greedy(hf, out.prompt_token_ids, 4)
        engine = llm.engine
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.kv_cache_usage() == 0.0 or prefix_cache
    finally:
        llm.shutdown()


def test_scoring_takes_no_decode_step_and_bad_k_is_refused(tiny):
    folder, hf = tiny
    llm = make_llm(folder)
    try:
        ids = prompts()[0]
        engine = llm.engine
        steps_before = engine.num_steps
        out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
        # One step computes the whole prompt (it fits the token budget); overlap may run one more empty call.
        assert engine.num_steps - steps_before <= 2
        check(out, hf, 0)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=MAX_LOGPROBS + 1), use_tqdm=False)
        with pytest.raises(ValueError, match="max_tokens"):
            llm.generate([ids], SamplingParams(max_tokens=0), use_tqdm=False)
        # An aborted scoring request is forgotten; the engine goes on.
        engine.add_request("aborted", ids, SamplingParams(max_tokens=0, prompt_logprobs=1))
        engine.abort_request("aborted")
        again = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
        check(again, hf, 2)
        assert engine.runner.prompt_logprobs.requests == {}
        assert engine.num_generation_tokens == 0  # scoring generates nothing
    finally:
        llm.shutdown()


def test_prompt_logprobs_survive_preemption(tiny):
    """A pool too small for all requests at once: preempted scoring requests recompute, and score each prompt
    token once."""
    folder, hf = tiny
    llm = make_llm(folder, num_kv_blocks=12, max_num_batched_tokens=32)
    try:
        ps = [p for p in prompts() if len(p) > 30]
        params = SamplingParams(temperature=0.0, max_tokens=40, prompt_logprobs=1, ignore_eos=True)
        outs = llm.generate(ps * 2, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        for out in outs:
            check(out, hf, 1)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_prompt_logprobs_beside_a_grammar_row(tiny, tmp_path, overlap):
    """A step whose sampling waits for a grammar bitmask brings the prompt rows back with its deferred D2H."""
    from tandem.sampling_params import StructuredOutputParams
    from tests.parallel.tiny_models import save_tiny_tokenizer

    folder, hf = tiny
    with_tokenizer = save_tiny_tokenizer(save_tiny("llama", tmp_path / "with-tokenizer"))
    llm = make_llm(with_tokenizer, overlap=overlap, grammar_backend="xgrammar")
    try:
        ps = prompts()
        constrained = SamplingParams(temperature=0.0, max_tokens=6,
                                     structured_output=StructuredOutputParams(regex="[a-z]{3}"))
        scoring = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
        outs = llm.generate([ps[1], ps[0], ps[3]], [constrained, scoring, scoring], use_tqdm=False)
        # (The tiny config's EOS id is the tokenizer's "a": the grammar row may stop on it.)
        assert outs[0].outputs[0].text.isalpha() and outs[0].outputs[0].text.islower()
        assert llm.engine.num_mask_steps > 0
        for out in outs[1:]:
            check(out, hf, 2)
            assert out.outputs[0].token_ids == ref_greedy(hf, out.prompt_token_ids, 3)
    finally:
        llm.shutdown()
