"""AdapterSlots: which LoRA adapter holds each of the device pool's slots, and which adapters must page in."""

from __future__ import annotations

from collections import OrderedDict

from tandem.lora_request import LoRARequest
from tandem.request import Request


class AdapterSlots:
    """max_loras slots shared by the running requests' adapters. A request is admitted once its adapter holds a
    slot (acquire); a slot no running request uses is reused least recently released first, and every adapter
    given a slot is listed in take_loads() for the runner to page in before the step that first reads it.

    Steps are counted (begin_step, once per schedule) so that a page-in knows whether the slot it overwrites may
    still be read by the step in flight: only a slot released since the previous step was scheduled can be (the
    overlap loop has at most that one step on the device while the next is prepared)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self.owner: list[int | None] = [None] * max_loras  # slot -> lora_int_id
        self.refs = [0] * max_loras  # running requests per slot
        self.idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # refs 0, LRU first
        self._loads: list[tuple[int, LoRARequest]] = []  # (slot, adapter) to page in before the next step
        self.step = 0  # schedule() calls so far (the step being scheduled)
        self.released_at = [-2] * max_loras  # slot -> the step being scheduled (or last scheduled) when refs hit 0
        self._loads_busy = False  # some listed page-in overwrites a slot the step in flight may read

    def begin_step(self) -> None:
        self.step += 1

    def can_acquire(self, request: Request) -> bool:
        """Whether acquire(request) would succeed now: no adapter, its adapter resident, or a slot idle."""
        lora = request.lora_request
        return lora is None or request.lora_slot >= 0 or lora.lora_int_id in self.slot_of or bool(self.idle)

    def acquire(self, request: Request) -> bool:
        """Gives the request its adapter's slot (paging it in if needed); False while every slot is in use."""
        lora = request.lora_request
        if lora is None or request.lora_slot >= 0:
            return True
        lora_id = lora.lora_int_id
        slot = self.slot_of.get(lora_id)
        if slot is None:
            if not self.idle:
                return False
            slot, _ = self.idle.popitem(last=False)
            evicted = self.owner[slot]
            if evicted is not None:
                del self.slot_of[evicted]
            self.owner[slot], self.slot_of[lora_id] = lora_id, slot
            self._loads.append((slot, lora))
            # Released while the previous step was scheduled or since: that step (maybe still running) read it.
            self._loads_busy |= self.released_at[slot] >= self.step - 1
        elif self.refs[slot] == 0:
            del self.idle[slot]
        self.refs[slot] += 1
        request.lora_slot = slot
        return True

    def release(self, request: Request) -> None:
        """The request stops using its slot (finished or preempted); the adapter stays resident until reused."""
        slot = request.lora_slot
        if slot < 0:
            return
        request.lora_slot = -1
        self.refs[slot] -= 1
        assert self.refs[slot] >= 0, f"adapter slot {slot} released more often than acquired"
        if self.refs[slot] == 0:
            self.idle[slot] = None
            self.released_at[slot] = self.step

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: requests still running keep reading its slot until they release it, but no new
        request maps to it; the id, if loaded again, pages in anew. An idle slot becomes the first to reuse."""
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is None:
            return
        self.owner[slot] = None
        if self.refs[slot] == 0:
            self.idle.move_to_end(slot, last=False)

    @property
    def loads_overwrite_busy(self) -> bool:
        """Whether a page-in listed since the last take_loads() overwrites a slot that the step in flight may still
        read (its copy must then wait for that step's compute; others need not)."""
        return self._loads_busy

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        loads, self._loads, self._loads_busy = self._loads, [], False
        return loads
