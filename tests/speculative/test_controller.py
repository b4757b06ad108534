"""SpecController: speculation stays on while its steps cost less per token than plain ones, goes off when they
cost more, and is tried again later."""

from __future__ import annotations

from tandem.speculative.controller import SpecController


def _run(controller: SpecController, spec_cost: float, plain_cost: float, steps: int) -> list[bool]:
    modes = []
    for _ in range(steps):
        speculated = controller.speculate()
        modes.append(speculated)
        controller.record(speculated, spec_cost if speculated else plain_cost, 1)
    return modes


def test_cost_per_token_is_the_ratio_of_the_averages():
    """Speculating steps alternately accept nothing (5 ms, 1 token) and four drafts (5 ms, 5 tokens), plain steps
    take 4 ms a token: speculation costs 10 ms for 6 tokens, 1.7 ms a token. The mean of the per-step ratios (5 and
    1 ms: 3 ms) would understate its advantage; the ratio of the averages does not."""
    c = SpecController(probe_every=1000, probe_len=1)
    for i in range(200):
        c.record(True, 0.005, 1 if i % 2 else 5)
        c.record(False, 0.004, 1)
    assert c.spec_cost is not None and c.plain_cost is not None
    assert c.spec_cost < 0.5 * c.plain_cost
    assert c.speculating


def test_speculation_that_pays_stays_on_with_plain_probes():
    c = SpecController(probe_every=16, probe_len=2, retry_every=64)
    modes = _run(c, spec_cost=0.5, plain_cost=1.0, steps=160)
    assert c.speculating
    assert 0.8 < sum(modes) / len(modes) < 0.95  # plain probes only
    assert not all(modes[32:48])  # a probe in every window


def test_speculation_that_costs_goes_off_and_is_retried():
    c = SpecController(probe_every=16, probe_len=2, retry_every=64)
    modes = _run(c, spec_cost=2.0, plain_cost=1.0, steps=200)
    assert not c.speculating
    off = modes[40:]
    assert sum(off) / len(off) < 0.1  # a short trial every retry_every steps
    assert any(off)
    # The cost changes (a smaller batch, better acceptance): the next trial turns it back on.
    _run(c, spec_cost=0.3, plain_cost=1.0, steps=200)
    assert c.speculating


def test_steps_without_tokens_are_not_counted():
    c = SpecController()
    c.record(True, 1.0, 0)
    c.record(False, 0.0, 3)
    assert c.spec_avg is None and c.plain_avg is None


def test_speculation_that_costs_goes_off_within_its_first_steps():
    """With the default settings a proposer whose steps cost twice a plain step's per token is off after
    decide_after (16) steps: a short request pays for it briefly."""
    c = SpecController()
    modes = _run(c, spec_cost=2.0, plain_cost=1.0, steps=40)
    assert not c.speculating
    assert sum(modes) <= c.decide_after and not any(modes[c.decide_after + 1 :])
