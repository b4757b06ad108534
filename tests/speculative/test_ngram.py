"""Speculative decoding with the n-gram proposer on the CPU: the same tokens as decoding without it (greedy and
seeded sampling, overlap on and off, prefix cache, chunked prefill, preemption, stop tokens inside an accepted
run), drafts really accepted and rejected, no KV block lost, and a clear error for a bad speculative_config."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, SpeculativeConfig
from tandem.speculative.ngram import NgramProposer
from tests.parallel.tiny_models import VOCAB, save_tiny

ENGINE = dict(device="cpu", dtype="float32", max_model_len=160, max_num_seqs=4, block_size=8,
              max_num_batched_tokens=16)  # 16-token budget: the 30-token prompts prefill in chunks
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}
PREFIX = [(7 * i) % (VOCAB - 4) + 4 for i in range(24)]


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(1, 3)
    # The suffix [1, 2, 3] occurs at 0 and 5: the latest is used, and up to 4 tokens that followed it.
    assert p.propose([1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 5, 1, 2, 3], 4) == [7, 6, 5, 1]
    # No 3- or 2-gram match, a 1-gram one: [5] occurred at index 1 (latest before the end).
    assert p.propose([4, 5, 6, 7, 5], 2) == [6, 7]
    assert p.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert p.propose([1, 2, 1, 2], 0) == []
    assert p.propose([1, 1], 5) == [1]  # the continuation stops at the known tokens
    assert NgramProposer(2, 2).propose([3, 4, 5, 3], 2) == []  # a 1-gram match is below prompt_lookup_min


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def _workload(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    """Prompts that repeat themselves (the random model's greedy output loops too, so drafts match), a prefix hit,
    a chunked 30-token prefill, seeded sampling, logprobs and a stop token; returns (tokens, chosen logprobs)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, ignore_eos=True, seed=11)
    first = llm.generate([PREFIX + [5, 9, 11]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    prompts = [PREFIX + [12, 13], [(3 * i) % 11 + 4 for i in range(30)], [40, 41, 42, 43] * 7, [99, 98, 99]]
    outs = llm.generate(prompts, [greedy, greedy, sampled, greedy], use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in first + outs]
    logprobs = [[entry[t] for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs if o.outputs[0].logprobs is not None]
    return tokens, logprobs


@pytest.mark.parametrize("overlap", [True, False])
def test_ngram_tokens_equal_decoding_without_drafts(folder, overlap, monkeypatch):
    import tandem.runner.model_runner as model_runner

    reference = LLM(folder, num_kv_blocks=256, overlap=overlap, **ENGINE)
    expected, expected_lp = _workload(reference)
    # Both layouts of a verify step: one row per token (every sequence decodes or verifies) and drafts beside a
    # prefill chunk (their sequences as short prefills, extra logits rows).
    kinds = {"flat": 0, "mixed": 0}
    flat, mixed = model_runner.write_flat_verify, model_runner.write_step

    def count_flat(*args, **kwargs):
        kinds["flat"] += 1
        return flat(*args, **kwargs)

    def count_mixed(buf, sched, *args, **kwargs):
        kinds["mixed"] += sched.num_draft_tokens > 0
        return mixed(buf, sched, *args, **kwargs)

    monkeypatch.setattr(model_runner, "write_flat_verify", count_flat)
    monkeypatch.setattr(model_runner, "write_step", count_mixed)
    # A 14-block pool: four requests of up to ~54 tokens need more, so some are preempted and recomputed.
    llm = LLM(folder, num_kv_blocks=14, overlap=overlap, speculative_config=SPEC, **ENGINE)
    got, got_lp = _workload(llm)
    stats = llm.engine.stats()
    assert got == expected
    for a, b in zip(got_lp, expected_lp):
        assert a == pytest.approx(b, abs=1e-4)
    assert stats.spec_accepted_tokens > 0, "the repeating prompts should have drafts accepted"
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens, "some drafts should have been rejected"
    assert list(stats.spec_accepted_per_position) == sorted(stats.spec_accepted_per_position, reverse=True)
    assert stats.num_preemptions > 0, "the 14-block pool should force preemption"
    assert kinds["flat"] > 0 and kinds["mixed"] > 0, kinds
    assert llm.engine.scheduler.num_free_blocks() == 13, "KV blocks leaked"
    llm.engine.scheduler.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("overlap", [True, False])
def test_penalties_and_bias_with_drafts_equal_decoding_without(folder, overlap):
    """Requests with repetition / presence / frequency penalties, logit_bias or allowed_token_ids take drafts too:
    each verified row's penalties count the drafts before it, and only the tokens a verify keeps are counted after
    it. Greedy and seeded sampling, beside a request without any, in both verify layouts (the 30-token prompt
    prefills in chunks beside rows that verify)."""
    penalties = dict(repetition_penalty=1.15, presence_penalty=0.3, frequency_penalty=0.2)
    mild = dict(repetition_penalty=1.02, presence_penalty=0.02, frequency_penalty=0.01)  # loops go on: drafts kept
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **mild),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={44: 2.0, 41: -1.5}),
              SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, ignore_eos=True, seed=5, **penalties),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             allowed_token_ids=list(range(38, 60)), repetition_penalty=1.1),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    prompts = [[40, 41, 42, 43] * 6, [50, 51, 52] * 8, [40, 41, 42, 43] * 6, [44, 45, 46, 47] * 6,
               [(3 * i) % 11 + 4 for i in range(30)]]
    engine = {**ENGINE, "max_num_seqs": 5}
    reference = LLM(folder, num_kv_blocks=256, overlap=overlap, **engine)
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    llm = LLM(folder, num_kv_blocks=256, overlap=overlap, speculative_config=SPEC, **engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    metrics = [o.metrics for o in outs]
    assert all(m["spec_draft_tokens"] > 0 for m in metrics[:4]), metrics  # logits state does not bar drafts
    # ... and some are kept: the counts after a verify hold exactly the kept tokens, or later rows would differ
    assert all(metrics[i]["spec_accepted_tokens"] > 0 for i in (0, 1, 3)), metrics
    state = llm.engine.runner.logits_state
    for req, row in state.held.values():  # the device counts hold each output token once, rejected drafts none
        want = torch.bincount(torch.tensor(req.output_token_ids), minlength=state.vocab_size).int()
        assert torch.equal(state.counts[row], want), req.request_id
    assert llm.engine.scheduler.num_free_blocks() == 255, "KV blocks leaked"


def test_stop_token_and_max_tokens_inside_an_accepted_run(folder):
    prompt = [40, 41, 42, 43] * 7
    reference = LLM(folder, num_kv_blocks=64, **ENGINE)
    free = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    stop = free[9]  # ends the output at its first occurrence, at or before the 10th token
    llm = LLM(folder, num_kv_blocks=64, speculative_config=SPEC, **ENGINE)
    params = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]),
              SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)]
    want = reference.generate([prompt, prompt], params, use_tqdm=False)
    got = llm.generate([prompt, prompt], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].token_ids[-1] == stop
    assert len(got[1].outputs[0].token_ids) == 13
    assert got[1].metrics["spec_accepted_tokens"] > 0
    assert got[1].metrics["spec_draft_tokens"] >= got[1].metrics["spec_accepted_tokens"]
    assert llm.engine.scheduler.num_free_blocks() == 63


@pytest.mark.parametrize("config, field", [
    ({"method": "medusa2"}, "method"),
    ({"method": "draft_model"}, "model"),
    ({"method": "ngram", "model": "x"}, "model"),
    ({"method": "eagle3"}, "model"),
    ({"method": "mtp"}, "not available yet"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "k": 2}, "unknown fields"),
])
def test_bad_speculative_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=config)


def test_speculative_config_from_dict():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=5)


def test_tp2_with_drafts_equals_tp1_without(folder):
    """Drafts are proposed once on rank 0 and reach the other rank with the step's inputs; both ranks verify."""
    reference = LLM(folder, num_kv_blocks=256, **ENGINE)
    expected, _ = _workload(reference)
    reference.shutdown()
    sharded = LLM(folder, num_kv_blocks=64, tensor_parallel_size=2, speculative_config=SPEC, **ENGINE)
    try:
        got, _ = _workload(sharded)
        stats = sharded.engine.stats()
    finally:
        sharded.shutdown()
    assert got == expected
    assert stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_switching_speculation_on_and_off_every_step_keeps_the_tokens(folder, overlap):
    """A verify step in flight is collected before the next step is scheduled even when that step proposes
    nothing (the controller's plain probes, or more requests than disable_by_batch_size)."""
    from tandem.speculative.controller import SpecController

    reference = LLM(folder, num_kv_blocks=256, overlap=overlap, **ENGINE)
    expected, _ = _workload(reference)
    llm = LLM(folder, num_kv_blocks=64, overlap=overlap, speculative_config={**SPEC, "adaptive": True}, **ENGINE)
    llm.engine.spec_controller = SpecController(probe_every=2, probe_len=1, retry_every=1)
    got, _ = _workload(llm)
    assert got == expected
    assert llm.engine.stats().spec_accepted_tokens > 0


def test_idle_time_between_runs_is_not_timed_as_a_step(folder):
    import time

    # Without overlap a run's first step already yields a token: its time must not include the sleep.
    llm = LLM(folder, num_kv_blocks=64, overlap=False, speculative_config={**SPEC, "adaptive": True}, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    from tandem.speculative.controller import SpecController

    timed: list[float] = []

    class Recording(SpecController):
        def record(self, speculated: bool, seconds: float, num_tokens: int) -> None:
            timed.append(seconds)
            super().record(speculated, seconds, num_tokens)

    llm.engine.spec_controller = Recording()
    llm.generate([[40, 41, 42, 43] * 7], params, use_tqdm=False)
    time.sleep(1.0)
    llm.generate([[40, 41, 42, 43] * 7], params, use_tqdm=False)
    assert len(timed) >= 8 and max(timed) < 0.5, timed

