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


def _request(rid: str, lora: LoRARequest | None, prompt: list[int] | None = None) -> Request:
    return Request(rid, prompt or [1, 2, 3], SamplingParams(max_tokens=4), frozenset(), 64, 0, lora_request=lora)


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
        sched.add_request(_request(rid, lora))
    out = sched.schedule()
    # FIFO: 1 takes the slot, the base-model request runs, 3 waits for the slot (and so does 4 behind it).
    assert [s.request.request_id for s in out.scheduled] == ["1", "2"] and out.lora_loads == [(0, A)]
    sched.finish_request("1", FinishReason.ABORT)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled][-1] == "3" and out.lora_loads == [(0, B)]


def test_prefix_hashes_differ_per_adapter():
    assert adapter_root(_request("1", None)) is None
    roots = {adapter_root(_request(str(i), lora)) for i, lora in enumerate((A, B, C))}
    assert len(roots) == 3 and adapter_root(_request("9", A)) in roots
