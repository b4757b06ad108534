"""HostAdapters: the host copies of LoRA adapters (read, packed, pinned), made on a loader thread ahead of the step
that pages them in, in an LRU of at most max_cpu_loras that never drops a copy a request still needs."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from tandem.lora.pack import PackedAdapter
from tandem.lora_request import LoRARequest

logger = logging.getLogger(__name__)


class HostAdapters:
    """Copies being made (`loading`) and made (`cpu`) count against `capacity` together. A request pins its adapter
    from arrival to its end: a pinned copy is never dropped, so the step that pages the adapter in finds it (and
    one that pages it in again after its slot was reused). A copy that no room is left for waits in `wanted`, in
    order, until an unpinned copy can go (least recently used first) or a pin ends."""

    def __init__(self, make: Callable[[LoRARequest], PackedAdapter], capacity: int) -> None:
        self._make = make  # runs on the loader thread: reads the folder, packs and pins (no shared state)
        self.capacity = capacity
        self.cpu: OrderedDict[int, PackedAdapter] = OrderedDict()  # lora_int_id -> made, least recent first
        self.loading: dict[int, tuple[LoRARequest, Future[PackedAdapter]]] = {}
        self.wanted: OrderedDict[int, LoRARequest] = OrderedDict()  # waiting for room, in order
        self.pins: dict[int, int] = {}  # lora_int_id -> requests that need its copy
        self.forgotten: set[int] = set()  # unloaded while pinned: the copy goes with the last pin
        self.failures: list[BaseException] = []  # copies no request pinned that failed (wait() raises the first)
        self._pool: ThreadPoolExecutor | None = None

    def want(self, request: LoRARequest) -> None:
        """Makes the adapter's host copy (on the loader thread) unless it is there or under way."""
        lora_id = request.lora_int_id
        self.forgotten.discard(lora_id)
        if lora_id in self.cpu:
            self.cpu.move_to_end(lora_id)
        elif lora_id not in self.loading and lora_id not in self.wanted:
            self.wanted[lora_id] = request
        self._start()

    def pin(self, request: LoRARequest) -> None:
        self.pins[request.lora_int_id] = self.pins.get(request.lora_int_id, 0) + 1
        self.want(request)

    def unpin(self, lora_int_id: int) -> None:
        left = self.pins[lora_int_id] - 1
        if left:
            self.pins[lora_int_id] = left
            return
        del self.pins[lora_int_id]
        if lora_int_id in self.forgotten:
            self.forgotten.discard(lora_int_id)
            self.cpu.pop(lora_int_id, None)
        self._start()  # its copy may make room for a wanted one now

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: its copy goes now unless a request still needs it (then it stays until evicted)."""
        self.wanted.pop(lora_int_id, None)
        if lora_int_id in self.pins:
            self.forgotten.add(lora_int_id)
            return
        self.cpu.pop(lora_int_id, None)
        entry = self.loading.pop(lora_int_id, None)
        if entry is not None:
            entry[1].cancel()  # a copy already being made is dropped when done
        self._start()

    def ready(self, request: LoRARequest) -> bool:
        """Whether a wanted adapter's copy is made; raises what making it raised (the copy is then not kept)."""
        lora_id = request.lora_int_id
        if lora_id in self.cpu:
            self.cpu.move_to_end(lora_id)
            return True
        entry = self.loading.get(lora_id)
        if entry is None:
            self.want(request)  # dropped while unpinned, or failed for an earlier request: make it again
            return False
        made_for, future = entry
        if not future.done():
            return False
        del self.loading[lora_id]
        adapter = future.result()  # raises the loader's ValueError, naming the adapter
        if made_for != request:  # the id was unloaded and loaded again from elsewhere while this one was made
            self.want(request)
            return False
        self.cpu[lora_id] = adapter
        return True

    def get(self, lora_int_id: int) -> PackedAdapter | None:
        adapter = self.cpu.get(lora_int_id)
        if adapter is not None:
            self.cpu.move_to_end(lora_int_id)
        return adapter

    def put(self, adapter: PackedAdapter) -> PackedAdapter:
        """A copy made on the caller's thread (ranks that get page-ins from rank 0), kept as the LRU allows."""
        self.cpu[adapter.lora_int_id] = adapter
        while len(self.cpu) + len(self.loading) > self.capacity and self._evict():
            pass
        return adapter

    def wait_any(self, timeout: float) -> None:
        """Blocks up to `timeout` seconds for some copy under way to be done (nothing else to do meanwhile)."""
        if self.loading:
            futures_wait([f for _, f in self.loading.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the copies under way, and those wanted that fit, are made (a preload before a benchmark);
        raises the first failure of a copy no request pinned (a pinned one's failure goes to its requests through
        ready()). TimeoutError when `timeout` seconds pass first."""
        while True:
            self._start()
            pending = [f for _, f in self.loading.values() if not f.done()]
            if not pending:
                break
            done, _ = futures_wait(pending, timeout=timeout)
            if not done:
                raise TimeoutError(f"LoRA host copies not made within {timeout} s")
        self._reap()
        for request, future in list(self.loading.values()):
            if future.exception() is None:
                self.ready(request)  # pinned: in the LRU now
        if self.failures:
            failure, self.failures = self.failures[0], []
            raise failure

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _start(self) -> None:
        """Starts wanted copies, in order, while there is room (evicting unpinned copies for it)."""
        if not self.wanted:
            return
        self._reap()
        while self.wanted:
            if len(self.cpu) + len(self.loading) >= self.capacity and not self._evict():
                return
            lora_id, request = self.wanted.popitem(last=False)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
            self.loading[lora_id] = (request, self._pool.submit(self._make, request))

    def _evict(self) -> bool:
        for lora_id in self.cpu:
            if lora_id not in self.pins:
                del self.cpu[lora_id]
                return True
        return False

    def _reap(self) -> None:
        """Moves finished copies that no request pinned (preloads) into the LRU; keeps their failures for wait()."""
        for lora_id, (_, future) in list(self.loading.items()):
            if lora_id in self.pins or not future.done():
                continue
            del self.loading[lora_id]
            exc = None if future.cancelled() else future.exception()
            if exc is not None:
                logger.warning("LoRA adapter %d could not be loaded: %s", lora_id, exc)
                self.failures.append(exc)
            elif not future.cancelled():
                self.cpu[lora_id] = future.result()
