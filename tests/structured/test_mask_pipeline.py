"""The mask fill off the critical path: the next step's fill starts as soon as a step's tokens land (before the
requests are updated) and gives the tokens of the sync loop; the slow rows of a parallel fill are spaced out,
which changes no bit; the GIL switch interval is short only while a fill runs."""

from __future__ import annotations

import json
import random
import sys
import threading

import numpy as np
import pytest
import torch

from tandem.sampling_params import SamplingParams, StructuredOutputParams
from tandem.structured.grammar import GrammarCache
from tandem.structured.matcher import HostMask, dense_rows, spread_slow_rows
from tandem.structured.pipeline import FILL_SWITCH_INTERVAL_S, GrammarPipeline
from tests.structured.schemas import SCHEMAS

VOCAB = 300  # the synthetic vocabulary: token t is chr(t + 32) for the printable ASCII


def _random_flags(seed: int) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() < 0.3 for _ in range(64)]


@pytest.mark.parametrize("slow", [[True] * 3 + [False] * 5, [False, False, True, True], [True, True], [False] * 4, [],
                                  _random_flags(0), _random_flags(1)])
def test_spread_slow_rows_spaces_the_slow_rows_evenly(slow):
    order = spread_slow_rows(slow)
    assert sorted(order) == list(range(len(slow)))
    positions = [p for p, row in enumerate(order) if slow[row]]
    k, n = len(positions), len(slow)
    if 0 < k < n:
        assert positions == [j * n // k for j in range(k)]
        assert all(b - a > 1 for a, b in zip(positions, positions[1:])) or 2 * k > n


def test_dense_rows_tells_a_mostly_allowed_row():
    bits = np.zeros((3, 64), dtype=np.int32)
    bits[0] = -1  # everything allowed
    bits[1, ::2] = -1  # half the words: not more than half
    bits[2, :] = 0x7FFFFFFF  # 31 of 32 tokens
    assert dense_rows(bits, [0, 1, 2]) == [True, False, True]
    assert dense_rows(bits[:, :3], [2, 0]) == [True, True]  # a vocabulary narrower than the band


def _matchers_in_varied_states(compiled, rows: int, seed: int) -> list[HostMask]:
    rng = random.Random(seed)
    bits = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    masks = []
    for _ in range(rows):
        mask = HostMask(compiled)
        for _ in range(rng.randrange(12)):
            HostMask.fill_rows(bits, [(0, mask, [])])
            allowed = np.flatnonzero(np.unpackbits(bits[0].numpy().view(np.uint8), bitorder="little")[:VOCAB])
            if mask.is_terminated or not len(allowed):
                break
            mask.accept(int(allowed[rng.randrange(len(allowed))]))
        masks.append(mask)
    return masks


@pytest.fixture
def varied_masks():
    """24 llguidance matchers of a small schema (a bounded string and an integer) in varied states."""
    cache = GrammarCache(None, VOCAB, [VOCAB - 1], backend_name="llguidance")
    try:
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "n": {"type": "integer"}}, "required": ["name", "n"]}
        compiled = cache.submit(StructuredOutputParams(json=json.dumps(schema))).result()
        yield _matchers_in_varied_states(compiled, 24, seed=0)
    finally:
        cache.shutdown()


def test_spread_fill_writes_the_same_rows_as_the_list_order(varied_masks):
    masks = varied_masks
    rows = [(j, m, []) for j, m in enumerate(masks)]
    plain = torch.zeros(len(masks), (VOCAB + 31) // 32, dtype=torch.int32)
    HostMask.fill_rows(plain, rows, spread=False)
    dense = [m.dense for m in masks]
    assert any(dense) and not all(dense), "the states should mix strings (dense) and the rest"
    spread = torch.zeros_like(plain)
    HostMask.fill_rows(spread, rows, spread=True)
    assert torch.equal(plain, spread)


def test_switch_interval_is_short_only_while_a_fill_runs():
    pipeline = GrammarPipeline(None, VOCAB, [VOCAB - 1], "llguidance")
    before = sys.getswitchinterval()
    seen: list[float] = []
    release = threading.Event()

    def fill() -> None:
        release.wait(5)
        seen.append(sys.getswitchinterval())

    try:
        step = object()
        pipeline.start_fill(step, fill)
        assert pipeline.filling(step) and not pipeline.filling(object())
        pipeline.start_fill(step, fill)  # the same step again: the running fill stays the only one
        release.set()
        pipeline.finish(step, fill, lambda: None)
        assert seen == [pytest.approx(FILL_SWITCH_INTERVAL_S)]
        assert sys.getswitchinterval() == before and not pipeline.filling(step)
    finally:
        pipeline.shutdown()
        sys.setswitchinterval(before)


def _run(llm, overlap: bool, bad_words: bool = False) -> list[list[int]]:
    llm.engine.overlap = overlap
    schemas = SCHEMAS[:3]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=20,
                             bad_words=["the number"] if bad_words and i == 1 else None,
                             structured_output=StructuredOutputParams(json=json.dumps(s)))
              for i, s in enumerate(schemas)]
    params.append(SamplingParams(temperature=0.0, max_tokens=20))  # an unconstrained row beside them
    prompts = [f"JSON for {json.dumps(s)}:\n" for s in schemas] + ["Tell me about Paris."]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_next_fill_starts_when_the_tokens_land_and_keeps_the_sync_tokens(idle_llm, monkeypatch):
    """With overlap, step N+1's fill starts right after step N's wait, before N's tokens are applied to the
    requests; greedy and seeded outputs equal the sync loop's."""
    engine = idle_llm.engine
    calls: list[str] = []
    for owner, name in ((engine.runner, "wait"), (engine.grammar, "start_fill"),
                        (engine.scheduler, "update_from_output")):
        original = getattr(owner, name)

        def wrapped(*args, _f=original, _n=name, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(_n)
            return _f(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)
    sync = _run(idle_llm, overlap=False)
    assert "start_fill" not in calls
    calls.clear()
    assert _run(idle_llm, overlap=True) == sync
    early = sum(calls[i - 1] == "wait" and calls[i + 1] == "update_from_output"
                for i, c in enumerate(calls[1:-1], 1) if c == "start_fill")
    assert early >= 8 and early >= calls.count("start_fill") - 3, calls


def test_bad_words_beside_a_grammar_keep_the_sync_tokens(idle_llm):
    """A multi-token bad word's row reads its request's tokens, so its step's fill waits for the update."""
    assert _run(idle_llm, overlap=True, bad_words=True) == _run(idle_llm, overlap=False, bad_words=True)


def test_late_rows_sit_out_and_keep_the_sync_tokens(idle_llm, monkeypatch):
    """Likely slow grammar rows are computed apart; one still running when the GPU would wait (on the CPU: at once)
    sits its step out, and the next step computes its position again: greedy and seeded outputs equal the sync
    loop's, every row computed apart is settled, and no KV block stays held; with it switched off (engine.sit_out),
    nothing sits out and the outputs are the same."""
    from tandem.structured import matcher as matcher_module

    original = matcher_module._compute_row
    calls = [0]

    def slow_every_other(matcher, out):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] % 2:
            threading.Event().wait(0.03)
        original(matcher, out)

    monkeypatch.setattr(matcher_module, "_compute_row", slow_every_other)
    # Every grammar row counts as likely slow, so every step computes rows apart.
    monkeypatch.setattr(matcher_module, "dense_rows", lambda bits, indices: [True] * len(indices))
    engine = idle_llm.engine
    before = engine.grammar.num_sat_out
    sync = _run(idle_llm, overlap=False)
    assert calls[0] == 0 and engine.grammar.num_sat_out == before  # no step behind: nothing computed apart
    overlap = _run(idle_llm, overlap=True)
    assert overlap == sync
    assert calls[0] > 0 and engine.grammar.num_sat_out > before, (calls, engine.grammar.num_sat_out)
    assert all(mask.job is None for mask in (r.host_mask for r in engine.grammar.masks.values()) if mask)
    assert engine.scheduler.num_free_blocks() == engine.runner.num_blocks - 1
    # Switched off, every step waits for its rows: nothing sits out, and the tokens are the same.
    monkeypatch.setattr(engine, "sit_out", False)
    sat_out = engine.grammar.num_sat_out
    assert _run(idle_llm, overlap=True) == sync and engine.grammar.num_sat_out == sat_out


def test_rows_computed_apart_equal_the_parallel_fill_and_settle_where_nothing_defers(varied_masks):
    """A row computed apart (fill_rows' `defer`, its mask's last row dense) is left to `settle`, which writes the row
    the parallel fill writes; a fill without `defer` (a verify step's, say) settles such a row itself."""
    masks = varied_masks
    rows = [(j, m, []) for j, m in enumerate(masks)]
    plain = torch.zeros(len(masks), (VOCAB + 31) // 32, dtype=torch.int32)
    HostMask.fill_rows(plain, rows)
    dense = [j for j, m in enumerate(masks) if m.dense]
    assert 2 <= len(dense) < len(masks)
    apart = torch.zeros_like(plain)
    deferred = HostMask.fill_rows(apart, rows, defer=lambda i: True)
    assert deferred == dense and all(masks[j].job is not None for j in deferred)
    assert all(torch.equal(apart[j], torch.full_like(apart[j], -1)) for j in deferred)  # allow all until settled
    for j in deferred[1:]:
        masks[j].settle(apart[j])
    again = torch.zeros_like(plain)
    assert HostMask.fill_rows(again, rows) == []  # no defer: the row still computed apart is settled here
    assert masks[deferred[0]].job is None and torch.equal(again[deferred[0]], plain[deferred[0]])
    apart[deferred[0]] = again[deferred[0]]
    assert torch.equal(apart, plain) and torch.equal(again, plain)
    masks[0].settle()  # nothing computed apart: nothing to do
