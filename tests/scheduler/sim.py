"""A fake deterministic model and the sync / overlap engine loops that drive a Scheduler with it."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.request import FinishReason, Request
from tandem.sampling_params import SamplingParams
from tandem.scheduler import PLACEHOLDER_TOKEN_ID, Scheduler, SchedulerConfig, SchedulerOutput

VOCAB = 64
EOS = 7


def fake_next_token(tokens: list[int]) -> int:
    """next token = f(all previous tokens); token 0 (the placeholder id) is a legal output."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % VOCAB


def make_request(
    request_id: str,
    prompt: list[int],
    max_model_len: int = 1024,
    eos: bool = True,
    **params,
) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        eos_token_ids=frozenset({EOS}) if eos else frozenset(),
        max_model_len=max_model_len,
        sampling_seed=0,
    )


def clone(request: Request) -> Request:
    return Request(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        eos_token_ids=request.eos_token_ids,
        max_model_len=request.max_model_len,
        sampling_seed=request.sampling_seed,
    )


def reference(request: Request, config: SchedulerConfig | None = None) -> tuple[list[int], FinishReason]:
    """What the request generates when run alone, token by token (under the scheduler's context clamp)."""
    r = clone(request)
    if config is not None:
        r.limit_context(min(r.max_model_len, config.max_model_len, config.max_kv_tokens + 1))
    while True:
        r.append_output_token(fake_next_token(r.all_token_ids))
        if r.check_stop():
            return r.output_token_ids, r.finish_reason


class FakeGPU:
    """Executes SchedulerOutputs in launch order over a fake paged KV cache holding token ids.

    Every context is read back through the block table, so a wrong table, a block reused too
    early or a bad prefix hit changes (and is caught in) the context. Carried placeholders are
    resolved from the previous step's samples, as the GPU carry-over does.
    """

    def __init__(self, num_blocks: int, block_size: int, truth: dict[str, list[int]] | None = None) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.prev_samples: dict[str, int] = {}
        self.truth = truth  # request_id -> prompt + reference outputs
        self.num_carries = 0

    def _slot(self, block_ids: list[int], position: int) -> tuple[int, int]:
        block_id = block_ids[position // self.block_size]
        assert block_id != 0, "a computed position maps to the reserved block"
        return block_id, position % self.block_size

    def execute(self, out: SchedulerOutput) -> list[int]:
        # Every layer writes the whole batch's KV before attention reads it.
        for entry in out.scheduled:
            ids = list(entry.token_ids)
            if entry.carry:
                ids[-1] = self.prev_samples[entry.request.request_id]  # KeyError: nothing to carry
                self.num_carries += 1
            for j, token in enumerate(ids):
                b, o = self._slot(entry.block_ids, entry.num_computed_tokens + j)
                self.kv[b][o] = token
        samples: dict[str, int] = {}
        sampled: list[int] = []
        for entry in out.scheduled:
            end = entry.num_computed_tokens + entry.num_scheduled_tokens
            context = [self.kv[b][o] for b, o in (self._slot(entry.block_ids, p) for p in range(end))]
            rid = entry.request.request_id
            if self.truth is not None:
                truth = self.truth[rid]
                assert end <= len(truth) and context == truth[:end], f"{rid}: wrong KV context"
            token = fake_next_token(context) if entry.sample else -1
            if entry.sample:
                samples[rid] = token
            sampled.append(token)
        self.prev_samples = samples
        return sampled


def check_output(sched: Scheduler, out: SchedulerOutput, overlap: bool) -> None:
    """Structural checks on one step, right after schedule() (before any update of it)."""
    cfg = sched.config
    assert out.num_scheduled_tokens == sum(e.num_scheduled_tokens for e in out.scheduled)
    assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert len({e.request.request_id for e in out.scheduled}) == len(out.scheduled)
    for e in out.scheduled:
        r = e.request
        start, end = e.num_computed_tokens, e.num_computed_tokens + e.num_scheduled_tokens
        assert e.num_scheduled_tokens > 0 and len(e.token_ids) == e.num_scheduled_tokens
        assert not r.is_finished and r.request_id not in out.preempted_request_ids
        # The pending position, if any, is last and flagged carry; every other id is known.
        assert e.carry == (end == r.num_tokens + 1) and end <= r.num_tokens + 1
        known = e.token_ids[:-1] if e.carry else e.token_ids
        assert known == r.all_token_ids[start : start + len(known)]
        if e.carry:
            assert overlap, "sync mode never has a token in flight"
            assert e.token_ids[-1] == PLACEHOLDER_TOKEN_ID and e.sample
        assert len(e.block_ids) * cfg.block_size >= end
        if not cfg.enable_chunked_prefill:
            assert e.sample


Event = Callable[[Scheduler], None]


@dataclass
class Driver:
    """Runs the engine loop; events fire before schedule() (`before`) or while the step is in flight (`during`)."""

    sched: Scheduler
    gpu: FakeGPU
    overlap: bool
    before: dict[int, list[Event]] = field(default_factory=dict)
    during: dict[int, list[Event]] = field(default_factory=dict)
    aborted: dict[str, int] = field(default_factory=dict)  # request_id -> outputs at abort time
    requests: dict[str, Request] = field(default_factory=dict)  # request_id -> the scheduler's Request
    num_steps: int = 0
    num_chunked: int = 0  # non-sampling (partial prefill) entries seen

    def abort(self, request_id: str) -> Event:
        def fire(sched: Scheduler) -> None:
            request = sched.abort_request(request_id)
            if request is not None:
                assert request.is_finished and request.finish_reason == FinishReason.ABORT
                self.aborted[request_id] = request.num_output_tokens

        return fire

    def _update(self, out: SchedulerOutput, sampled: list[int]) -> None:
        for request in self.sched.update_from_output(out, sampled, None):
            assert request.request_id not in self.aborted, "output after abort"

    def run(self, max_steps: int = 20_000) -> None:
        in_flight: tuple[SchedulerOutput, list[int]] | None = None
        while self.sched.has_unfinished_requests() or in_flight or self.before or self.during:
            assert self.num_steps < max_steps, "no progress"
            for event in self.before.pop(self.num_steps, []):
                event(self.sched)
            out = self.sched.schedule()
            check_output(self.sched, out, self.overlap)
            self.num_chunked += sum(1 for e in out.scheduled if not e.sample)
            sampled = self.gpu.execute(out)
            for event in self.during.pop(self.num_steps, []):
                event(self.sched)
            if self.overlap:
                if in_flight is not None:
                    self._update(*in_flight)
                in_flight = (out, sampled) if out.scheduled else None
            else:
                self._update(out, sampled)
            self.sched.kv_cache_manager.check_invariants()
            self.num_steps += 1
        assert self.sched.num_free_blocks() == self.sched.config.num_blocks - 1, "leaked blocks"


def random_workload(rng: random.Random, num_requests: int, max_prompt: int = 40, max_tokens: int = 24) -> list[Request]:
    """Prompts drawn around a few shared prefixes, with a mix of stop conditions."""
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, max_prompt))] for _ in range(3)]
    requests = []
    for i in range(num_requests):
        prefix = rng.choice(prefixes)[: rng.randrange(0, max_prompt)]
        tail = [rng.randrange(0, VOCAB) for _ in range(rng.randrange(1, 12))]
        kind = rng.random()
        params: dict = {"max_tokens": rng.randrange(1, max_tokens + 1)}
        if kind < 0.3:
            params["stop_token_ids"] = [rng.randrange(VOCAB) for _ in range(3)]
        elif kind < 0.4:
            params["ignore_eos"] = True
        elif kind < 0.5:
            params["min_tokens"] = rng.randrange(0, params["max_tokens"] + 1)
        requests.append(make_request(f"r{i}", (prefix + tail)[: max_prompt], **params))
    return requests


def run_workload(
    config: SchedulerConfig,
    requests: list[Request],
    overlap: bool,
    arrivals: dict[int, list[int]] | None = None,
    aborts_before: dict[int, list[str]] | None = None,
    aborts_during: dict[int, list[str]] | None = None,
) -> tuple[dict[str, tuple[list[int], FinishReason]], Driver]:
    """Runs clones of `requests` (arriving at the given steps, default all at step 0); returns outputs by id."""
    clones = [clone(r) for r in requests]
    truth = {r.request_id: r.prompt_token_ids + reference(r, config)[0] for r in requests}
    sched = Scheduler(config)
    driver = Driver(sched, FakeGPU(config.num_blocks, config.block_size, truth), overlap)
    driver.requests = {r.request_id: r for r in clones}
    arrivals = arrivals or {0: list(range(len(clones)))}
    for step, indices in arrivals.items():
        for i in indices:
            driver.before.setdefault(step, []).append(lambda s, r=clones[i]: s.add_request(r))
    for events, table in ((driver.before, aborts_before or {}), (driver.during, aborts_during or {})):
        for step, ids in table.items():
            events.setdefault(step, []).extend(driver.abort(rid) for rid in ids)
    driver.run()
    for r in clones:
        assert r.is_finished
    return {r.request_id: (r.output_token_ids, r.finish_reason) for r in clones}, driver
