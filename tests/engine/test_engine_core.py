"""EngineCore behaviour: prefix caching, preemption, aborts, bad input, and the one-wait invariant."""

from __future__ import annotations

import ast
import inspect
import random
import textwrap

import pytest

from tandem import LLM, SamplingParams
from tandem.request import FinishReason

LONG_SYSTEM = (
    "You are a meticulous assistant. Always answer in complete sentences, cite the relevant facts, "
    "and keep every answer under fifty words. Never invent information that was not given to you. "
) * 3


def test_prefix_cache_hits_give_same_tokens_and_report_cached_tokens(idle_llm):
    engine = idle_llm.engine
    prompts = [LONG_SYSTEM + q for q in ("What is rain?", "Why is grass green?", "Name a planet.")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.scheduler.reset_prefix_cache()
    first = idle_llm.generate(prompts[:1], params, use_tqdm=False)
    rest = idle_llm.generate(prompts, params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == rest[0].outputs[0].token_ids
    assert all(r.num_cached_tokens >= 16 for r in rest), [r.num_cached_tokens for r in rest]
    block = engine.config.block_size
    shared = len(idle_llm.get_tokenizer().encode(LONG_SYSTEM)) // block * block
    assert rest[1].num_cached_tokens >= shared - block
    engine.scheduler.reset_prefix_cache()
    cold = idle_llm.generate(prompts, params, use_tqdm=False)
    assert [c.outputs[0].token_ids for c in cold] == [r.outputs[0].token_ids for r in rest]
    assert cold[0].num_cached_tokens == 0


@pytest.fixture(scope="module")
def tiny_pool_llm():
    # 14 blocks x 16 tokens: six 70-token requests cannot all stay resident, so decode must preempt.
    return LLM(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8, num_kv_blocks=14,
               enable_prefix_caching=False)


def test_preemption_gives_the_same_tokens_as_a_large_pool(idle_llm, tiny_pool_llm):
    rng = random.Random(0)
    prompts = [[rng.randint(100, 40000) for _ in range(30)] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = idle_llm.generate(prompts, params, use_tqdm=False)
    for overlap in (True, False):
        tiny_pool_llm.engine.overlap = overlap
        small = tiny_pool_llm.generate(prompts, params, use_tqdm=False)
        assert [s.outputs[0].token_ids for s in small] == [b.outputs[0].token_ids for b in big]
    assert tiny_pool_llm.engine.stats().num_preemptions > 0
    sched = tiny_pool_llm.engine.scheduler
    assert sched.num_free_blocks() == tiny_pool_llm.engine.runner.num_blocks - 1


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_at_any_time_returns_every_block(idle_llm, overlap):
    engine = idle_llm.engine
    engine.overlap = overlap
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ids = [f"abort-{overlap}-{i}" for i in range(10)]
    for rid in ids:
        engine.add_request(rid, [rng.randint(100, 40000) for _ in range(rng.randint(5, 60))], params)
    aborted: set[str] = set()
    finished: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in aborted, "output after abort"
            finished[out.request_id] = finished.get(out.request_id, 0) + len(out.new_token_ids)
        steps += 1
        if steps in (1, 3, 7, 12):  # right after admission, mid-prefill, mid-decode (some in flight)
            victim = ids[steps % len(ids)]
            engine.abort_request(victim)
            aborted.add(victim)
    engine.abort_request("never-existed")  # unknown ids are ignored
    for rid in ids:
        if rid not in aborted:
            assert finished[rid] == 30


def test_bad_input_raises_clear_errors_and_engine_keeps_working(idle_llm):
    ok = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        idle_llm.generate("", ok, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        idle_llm.generate([[]], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="context"):
        idle_llm.generate([[5] * 2000], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="token id"):
        idle_llm.generate([[1, 2, 10**9]], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        idle_llm.generate("hello", SamplingParams(max_tokens=5000), use_tqdm=False)
    # a bad prompt in a batch queues nothing, and the engine still serves
    with pytest.raises(ValueError):
        idle_llm.generate(["fine", ""], ok, use_tqdm=False)
    assert not idle_llm.engine.has_unfinished_requests()
    out = idle_llm.generate(["Hello there"], ok, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_unknown_model_path_is_a_value_error():
    with pytest.raises(ValueError, match="not found|does not exist|no such"):
        LLM(model="/definitely/not/a/model", device="cpu")


def test_unknown_llm_argument_is_a_value_error():
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM(device="cpu", max_num_sequences=3)


def test_engine_stats_and_finish_reasons(idle_llm):
    engine = idle_llm.engine
    engine.add_request("stats-1", [101, 102, 103], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outs) == 3
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


# ---------------------------------------------------------------- invariant 1: one wait per step

FORBIDDEN = {"item", "cpu", "tolist", "synchronize", "numpy"}


def _calls(fn) -> list[tuple[str, str]]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FORBIDDEN:
            target = ast.unparse(node.func.value)
            found.append((node.func.attr, target))
    return found


def test_hot_path_never_waits_for_the_gpu_except_on_d2h_done():
    from tandem.engine.core import EngineCore
    from tandem.runner.cuda_graphs import DecodeGraphs
    from tandem.runner.executor import ModelExecutor
    from tandem.runner.host_masks import HostMaskBuffers
    from tandem.runner.input_buffers import StepBuffers, write_step
    from tandem.runner.logits_state import LogitsState
    from tandem.runner.model_runner import ModelRunner
    from tandem.runner.prompt_logprobs import PromptLogprobs
    from tandem.runner.sampler import sample
    from tandem.speculative.eagle3 import Eagle3Proposer
    from tandem.speculative.eagle3_rows import HeadSteps
    from tandem.structured.pipeline import GrammarPipeline

    hot = [ModelRunner.prepare, ModelRunner.enqueue, ModelRunner.enqueue_plan, ModelRunner._enqueue_sampling,
           ModelRunner.launch_sampling, ModelRunner.fill_masks, write_step, ModelExecutor.run, ModelExecutor.sample,
           ModelExecutor.forward, ModelExecutor.hidden, ModelExecutor.logits, ModelExecutor.sample_into,
           StepBuffers.upload, StepBuffers.download, DecodeGraphs.replay, DecodeGraphs.replay_sample, sample,
           LogitsState.prepare, LogitsState.upload, LogitsState.apply, LogitsState.count, HostMaskBuffers.fill,
           HostMaskBuffers.upload, HostMaskBuffers.apply, EngineCore.step, EngineCore._launch,
           EngineCore._launch_sampling, EngineCore._collect, EngineCore._update, EngineCore._propose,
           EngineCore._propose_forced, GrammarPipeline.start_fill,
           GrammarPipeline.finish, GrammarPipeline.join, PromptLogprobs.prepare, PromptLogprobs.upload,
           PromptLogprobs.compute, PromptLogprobs.download, Eagle3Proposer.observe, Eagle3Proposer._feed_flat,
           Eagle3Proposer._feed_grouped, HeadSteps.feed, HeadSteps.chain, HeadSteps._feed, HeadSteps._chain]
    for fn in hot:
        assert _calls(fn) == [], f"{fn.__qualname__} syncs with the GPU: {_calls(fn)}"
    # wait(): exactly one synchronize, on the step's d2h_done event; .tolist() only on host numpy views.
    calls = _calls(ModelRunner.wait)
    syncs = [c for c in calls if c[0] == "synchronize"]
    assert syncs == [("synchronize", "handle.events.d2h_done")]
    assert all(c[0] == "tolist" and "_np" in c[1] for c in calls if c[0] != "synchronize"), calls
    # The prompt rows' results are read after that wait, from host numpy views only.
    assert all(c[0] == "tolist" and "_np" in c[1] for c in _calls(PromptLogprobs.read)), _calls(PromptLogprobs.read)


@pytest.mark.parametrize("bad", [True, 1.0, -1, 100, None, "7"])
def test_check_new_request_names_a_bad_token_id_anywhere_in_a_long_prompt(bad):
    import enum

    from tandem.engine.core import check_new_request
    from tandem.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4)
    prompt = list(range(1, 90)) * 11
    check_new_request("ok", prompt, params, set(), 100, 4096)
    check_new_request("enum", [enum.IntEnum("E", "A B")(2)] + prompt, params, set(), 100, 4096)  # an int subclass
    for where in (0, 500, len(prompt)):
        bad_prompt = prompt[:where] + [bad] + prompt[where:]
        with pytest.raises(ValueError, match=rf"prompt token id {bad!r} is not an integer in \[0, 100\)"):
            check_new_request("bad", bad_prompt, params, set(), 100, 4096)
