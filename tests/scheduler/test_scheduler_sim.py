"""Scheduler simulations: sync and overlap loops over a fake model must match running each request alone."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.request import FinishReason
from tandem.scheduler import SchedulerConfig

from .sim import EOS, make_request, random_workload, reference, run_workload


def config(**overrides) -> SchedulerConfig:
    values = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4, num_blocks=400)
    values.update(overrides)
    return SchedulerConfig(**values)


CONFIGS = {
    "default": config(),
    "small-budget": config(max_num_batched_tokens=7, max_num_seqs=4),
    "no-chunking": config(max_num_batched_tokens=128, enable_chunked_prefill=False),
    "no-prefix-cache": config(enable_prefix_caching=False, block_size=3),
    "block-1": config(block_size=1),
    "one-seq": config(max_num_seqs=1, block_size=16),
    "tight-pool": config(num_blocks=20, max_model_len=72),
}


def random_arrivals(rng: random.Random, n: int, spread: int) -> dict[int, list[int]]:
    arrivals: dict[int, list[int]] = {}
    for i in range(n):
        arrivals.setdefault(rng.randrange(spread), []).append(i)
    return arrivals


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(4))
def test_sync_and_overlap_match_reference(name: str, seed: int) -> None:
    cfg = CONFIGS[name]
    rng = random.Random(seed)
    requests = random_workload(rng, 16)
    arrivals = random_arrivals(rng, len(requests), 30)
    expected = {r.request_id: reference(r, cfg) for r in requests}
    sync, _ = run_workload(cfg, requests, overlap=False, arrivals=arrivals)
    overlap, driver = run_workload(cfg, requests, overlap=True, arrivals=arrivals)
    assert sync == expected
    assert overlap == expected
    assert driver.gpu.num_carries > 0


def test_chunked_prefill_splits_long_prompts() -> None:
    cfg = config(max_num_batched_tokens=8, max_num_seqs=3)
    rng = random.Random(1)
    requests = [make_request(f"r{i}", [rng.randrange(1, 64) for _ in range(30 + i)], max_tokens=10) for i in range(5)]
    expected = {r.request_id: reference(r, cfg) for r in requests}
    for overlap in (False, True):
        outputs, driver = run_workload(cfg, requests, overlap=overlap)
        assert outputs == expected
        assert driver.num_chunked >= 5 * 3  # each 30+ token prompt takes >= 4 steps of 8


def test_prefix_cache_hits_report_cached_tokens_and_keep_outputs() -> None:
    shared = list(range(10, 30))  # 20 tokens = 5 blocks of 4
    requests = [
        make_request("a", shared + [1, 2, 3], max_tokens=6, eos=False),
        make_request("b", shared + [4, 5], max_tokens=6, eos=False),  # arrives after a's prefill
        make_request("c", shared + [4, 5], max_tokens=6, eos=False),  # same prompt as b, same step
        make_request("d", shared, max_tokens=6, eos=False),  # whole prompt cached: last block recomputed
    ]
    arrivals = {0: [0], 3: [1, 2], 5: [3]}
    cached = config(max_num_batched_tokens=32)
    uncached = config(max_num_batched_tokens=32, enable_prefix_caching=False)
    for overlap in (False, True):
        baseline, _ = run_workload(uncached, requests, overlap=overlap, arrivals=arrivals)
        outputs, driver = run_workload(cached, requests, overlap=overlap, arrivals=arrivals)
        assert outputs == baseline == {r.request_id: reference(r) for r in requests}
        by_id = driver.requests
        assert by_id["a"].num_cached_tokens == 0
        assert by_id["b"].num_cached_tokens == 20
        assert by_id["c"].num_cached_tokens == 20  # b published its blocks in the same step
        assert by_id["d"].num_cached_tokens == 16  # capped at num_tokens - 1, rounded down to a block
        assert driver.sched.prefix_cache_hit_rate() > 0.5


def test_tiny_pool_preempts_and_matches_large_pool() -> None:
    rng = random.Random(7)
    requests = random_workload(rng, 12, max_prompt=40, max_tokens=24)
    large = config(num_blocks=400, max_model_len=72)
    tiny = config(num_blocks=19, max_model_len=72)  # 18 blocks = 72 positions: one request always fits
    for overlap in (False, True):
        big_out, big = run_workload(large, requests, overlap=overlap)
        tiny_out, small = run_workload(tiny, requests, overlap=overlap)
        assert tiny_out == big_out
        assert big.sched.num_preemptions == 0 and small.sched.num_preemptions > 0


@pytest.mark.parametrize("seed", range(6))
def test_random_aborts_return_every_block(seed: int) -> None:
    rng = random.Random(100 + seed)
    requests = random_workload(rng, 14)
    cfg = config(num_blocks=30, max_num_batched_tokens=16, max_model_len=72)
    arrivals = random_arrivals(rng, len(requests), 10)
    ids = [r.request_id for r in requests]
    before = {rng.randrange(25): rng.sample(ids, 2) for _ in range(4)}
    during = {rng.randrange(25): rng.sample(ids, 2) for _ in range(4)}
    expected = {r.request_id: reference(r, cfg) for r in requests}
    for overlap in (False, True):
        outputs, driver = run_workload(cfg, requests, overlap, arrivals, before, during)
        assert driver.aborted, "the schedule should abort something"
        for rid, (tokens, reason) in outputs.items():
            if rid in driver.aborted:
                assert reason == FinishReason.ABORT and len(tokens) == driver.aborted[rid]
                assert tokens == expected[rid][0][: len(tokens)]
            else:
                assert (tokens, reason) == expected[rid]


def _find_prompt(predicate, **params):
    for seed in range(2000):
        rng = random.Random(seed)
        request = make_request("x", [rng.randrange(1, 64) for _ in range(rng.randrange(3, 12))], **params)
        if predicate(*reference(request)):
            return request
    raise AssertionError("no prompt found")


@pytest.mark.parametrize("overlap", [False, True])
def test_finish_reasons(overlap: bool) -> None:
    cfg = config(max_model_len=24)
    eos = _find_prompt(lambda toks, why: why == FinishReason.STOP and len(toks) > 2, max_tokens=10)
    plain = make_request("p", [3, 1, 4, 1, 5], max_tokens=8, eos=False)
    stop_token = reference(plain)[0][3]
    stop = make_request("s", [3, 1, 4, 1, 5], max_tokens=8, eos=False, stop_token_ids=[stop_token])
    length = make_request("l", [9, 9, 9], max_tokens=5, eos=False)
    context = make_request("c", [2] * 10, max_tokens=None, eos=False)
    ignore = make_request("i", eos.prompt_token_ids, max_tokens=10, ignore_eos=True)
    requests = [eos, plain, stop, length, context, ignore]
    outputs, driver = run_workload(cfg, requests, overlap=overlap)
    tokens, why = outputs["x"]
    assert why == FinishReason.STOP and tokens[-1] == EOS
    tokens, why = outputs["s"]
    assert why == FinishReason.STOP and tokens[-1] == stop_token and stop_token not in tokens[:-1]
    assert len(outputs["l"][0]) == 5 and outputs["l"][1] == FinishReason.LENGTH
    assert len(outputs["c"][0]) == 24 - 10 and outputs["c"][1] == FinishReason.LENGTH
    tokens, why = outputs["i"]
    assert len(tokens) == 10 and why == FinishReason.LENGTH and EOS in tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_pool_smaller_than_context_finishes_for_length(overlap: bool) -> None:
    cfg = config(num_blocks=6, block_size=4, max_model_len=100)  # 20 positions of KV
    requests = [make_request("a", [5] * 7, max_tokens=None, eos=False)]
    outputs, driver = run_workload(cfg, requests, overlap=overlap)
    assert outputs["a"] == reference(requests[0], cfg)
    assert len(outputs["a"][0]) == 21 - 7 and outputs["a"][1] == FinishReason.LENGTH


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    num_blocks=st.integers(4, 80),
    prefix_caching=st.booleans(),
    num_aborts=st.integers(0, 3),
)
def test_random_configs_sync_equals_overlap(
    seed: int, block_size: int, budget: int, max_num_seqs: int, num_blocks: int, prefix_caching: bool, num_aborts: int
) -> None:
    cfg = config(
        block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        num_blocks=num_blocks, enable_prefix_caching=prefix_caching, max_model_len=48,
    )
    rng = random.Random(seed)
    max_prompt = min(30, cfg.max_kv_tokens, 47)
    requests = random_workload(rng, 8, max_prompt=max_prompt, max_tokens=20)
    arrivals = random_arrivals(rng, len(requests), 12)
    ids = [r.request_id for r in requests]
    during = {rng.randrange(40): [rng.choice(ids)] for _ in range(num_aborts)}
    expected = {r.request_id: reference(r, cfg) for r in requests}
    for overlap in (False, True):
        outputs, driver = run_workload(cfg, requests, overlap, arrivals, aborts_during=during)
        for rid, (tokens, reason) in outputs.items():
            if rid in driver.aborted:
                assert reason == FinishReason.ABORT and tokens == expected[rid][0][: len(tokens)]
            else:
                assert (tokens, reason) == expected[rid]
