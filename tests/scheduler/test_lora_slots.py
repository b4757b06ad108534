"""AdapterSlots: a request is admitted once its adapter holds a device slot; idle slots are reused least recently
released first and every adapter given a slot is paged in once; the prefix cache keys blocks by adapter."""

from __future__ import annotations

from tandem.lora_request import LoRARequest
from tandem.request import FinishReason, Request
from tandem.sampling_params import SamplingParams
from tandem.scheduler.kv_cache_manager import adapter_root
from tandem.scheduler.lora_slots import AdapterSlots
from tandem.scheduler.scheduler import Scheduler, SchedulerConfig

A, B, C = (LoRARequest(n, i + 1, f"/adapters/{n}") for i, n in enumerate("abc"))


def _request(rid: str, lora: LoRARequest | None, prompt: list[int] | None = None, max_tokens: int = 4) -> Request:
    return Request(rid, prompt or [1, 2, 3], SamplingParams(max_tokens=max_tokens), frozenset(), 64, 0,
                   lora_request=lora)


def _step(sched: Scheduler):
    """One step without overlap: schedule it and hand back a token for every row."""
    out = sched.schedule()
    sched.update_from_output(out, [7] * len(out.scheduled))
    return out


def test_slots_page_in_once_and_reuse_the_least_recent():
    slots = AdapterSlots(2)
    r1, r2, r3, r4 = _request("1", A), _request("2", A), _request("3", B), _request("4", C)
    assert slots.acquire(r1) and slots.acquire(r2) and slots.acquire(r3)
    assert slots.take_loads() == [(0, A), (1, B)] and r1.lora_slot == r2.lora_slot == 0
    assert not slots.acquire(r4)  # both slots in use
    slots.release(r3)
    assert slots.acquire(r4) and r4.lora_slot == 1 and slots.take_loads() == [(1, C)]
    slots.release(r1)
    slots.release(r2)
    slots.release(r4)
    assert r1.lora_slot == -1
    again = _request("5", C)
    assert slots.acquire(again) and again.lora_slot == 1 and slots.take_loads() == []  # still resident
    assert slots.acquire(_request("6", None)) and slots.take_loads() == []  # the base model needs no slot


def test_forgotten_adapter_pages_in_anew():
    slots = AdapterSlots(1)
    running = _request("1", A)
    assert slots.acquire(running)
    slots.take_loads()
    slots.forget(A.lora_int_id)  # unloaded while running: it keeps its slot until it releases it
    assert running.lora_slot == 0 and not slots.acquire(_request("2", A))
    slots.release(running)
    late = _request("3", A)
    assert slots.acquire(late) and slots.take_loads() == [(0, A)]


def test_scheduler_admits_once_the_adapter_holds_a_slot():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                                      num_blocks=32, max_loras=1))
    for rid, lora in (("1", A), ("2", None), ("3", B), ("4", A)):
        sched.add_request(_request(rid, lora, max_tokens=40))
    out = _step(sched)
    # 1 takes the slot, the base-model request runs, 3 waits for the slot, and 4 (on 1's adapter) is not held
    # back behind it.
    assert [s.request.request_id for s in out.scheduled] == ["1", "2", "4"] and out.lora_loads == [(0, A)]
    assert [r.request_id for r in sched.waiting] == ["3"]
    sched.finish_request("1", FinishReason.ABORT)
    assert not _step(sched).lora_loads  # 4 still holds the slot
    sched.finish_request("4", FinishReason.ABORT)
    out = _step(sched)
    assert [s.request.request_id for s in out.scheduled][-1] == "3" and out.lora_loads == [(0, B)]


def _sched(max_loras: int, **kwargs) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                                     num_blocks=64, max_loras=max_loras, **kwargs))


def _ids(out) -> list[str]:
    return [s.request.request_id for s in out.scheduled if s.num_computed_tokens == 0]


def test_resident_adapters_pass_a_request_waiting_for_a_slot_in_arrival_order():
    """Two slots held by A and B; C waits; later requests on A or B (or none) are admitted in arrival order, and
    C takes the first slot freed, ahead of D that came after it."""
    sched = _sched(2)
    D = LoRARequest("d", 4, "/adapters/d")
    for rid, lora in (("a1", A), ("b1", B), ("c1", C), ("b2", B), ("d1", D), ("x", None), ("a2", A)):
        sched.add_request(_request(rid, lora, max_tokens=40))
    out = _step(sched)
    assert _ids(out) == ["a1", "b1", "b2", "x", "a2"] and out.lora_loads == [(0, A), (1, B)]
    assert [r.request_id for r in sched.waiting] == ["c1", "d1"]
    for rid in ("b1", "b2"):
        sched.finish_request(rid, FinishReason.ABORT)
    out = _step(sched)
    assert _ids(out) == ["c1"] and out.lora_loads == [(1, C)]
    assert [r.request_id for r in sched.waiting] == ["d1"]


def test_a_request_skipped_too_often_holds_later_adapter_requests_back():
    """One slot kept busy by a stream of A requests: B is passed over while A's keep coming, but after
    max_lora_skips steps of that no A request is admitted ahead of it; A's running ones finish and B runs."""
    sched = _sched(1, max_lora_skips=2)
    sched.add_request(_request("a0", A, max_tokens=40))
    sched.add_request(_request("b", B))
    assert _ids(_step(sched)) == ["a0"]
    admitted = []
    for step in range(1, 5):
        sched.add_request(_request(f"a{step}", A, max_tokens=40))
        sched.add_request(_request(f"x{step}", None))
        admitted += _ids(_step(sched))
    # Skipped twice (a1, a2 admitted ahead of it): a3 and a4 wait behind B; base-model requests still run.
    assert admitted == ["a1", "x1", "a2", "x2", "x3", "x4"]
    assert [r.request_id for r in sched.waiting] == ["b", "a3", "a4"]
    assert sched.requests["b"].num_lora_skips == 2
    for rid in ("a0", "a1", "a2"):
        sched.finish_request(rid, FinishReason.ABORT)
    out = _step(sched)
    assert _ids(out) == ["b"] and out.lora_loads == [(0, B)]


def test_a_page_in_waits_for_the_step_in_flight_only_over_a_slot_it_may_read():
    sched = _sched(2)
    sched.add_request(_request("a", A))
    out = _step(sched)
    assert out.lora_loads == [(0, A)] and not out.lora_loads_wait  # a slot never used
    sched.finish_request("a", FinishReason.ABORT)  # while the step that read slot 0 may be in flight
    sched.add_request(_request("b", B))
    out = _step(sched)
    assert out.lora_loads == [(1, B)] and not out.lora_loads_wait  # the idle, never-read slot goes first
    sched.add_request(_request("c", C))
    out = _step(sched)
    assert out.lora_loads == [(0, C)] and not out.lora_loads_wait  # slot 0 was released two steps ago
    sched.finish_request("b", FinishReason.ABORT)
    sched.finish_request("c", FinishReason.ABORT)
    sched.add_request(_request("a2", A))
    out = _step(sched)
    assert out.lora_loads == [(1, A)] and out.lora_loads_wait  # slot 1 was read by the step just scheduled


def test_prefix_hashes_differ_per_adapter():
    assert adapter_root(_request("1", None)) is None
    roots = {adapter_root(_request(str(i), lora)) for i, lora in enumerate((A, B, C))}
    assert len(roots) == 3 and adapter_root(_request("9", A)) in roots
