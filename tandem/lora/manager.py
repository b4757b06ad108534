"""LoRAManager: one rank's adapters: the registry of known adapters, their host copies (HostAdapters: an LRU of
max_cpu_loras, made on a loader thread), the device pool they page into, and the per-token slot region of each step's
buffers."""

from __future__ import annotations

import json
import logging

import numpy as np
import torch
from torch import nn

from tandem.lora.host import HostAdapters
from tandem.lora.pack import PackedAdapter, check_header, lora_targets, module_shapes, pack_adapter
from tandem.lora.peft import load_adapter, read_header
from tandem.lora.pool import LoRAPool
from tandem.lora_request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 max_num_tokens: int, dtype: torch.dtype, device: torch.device, tp_size: int = 1) -> None:
        self.targets = lora_targets(model)
        if not self.targets:
            raise ValueError(f"enable_lora: {type(model).__name__} has no projection an adapter can target "
                             "(q/k/v/o/gate/up/down of the Llama-family decoders)")
        self.max_rank, self.dtype, self.device, self.tp_size = max_rank, dtype, device, tp_size
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.pool = LoRAPool(self.targets, max_loras, max_rank, max_num_tokens, dtype, device)
        self.known: dict[int, LoRARequest] = {}  # lora_int_id -> its request (the path to reload it from)
        self.host = HostAdapters(self._pack, self.max_cpu_loras)  # host copies (LRU), made on a loader thread
        self._staged: list[tuple[int, PackedAdapter]] = []  # (slot, host copy) to page in with the next H2D
        self._staged_wait = False  # a staged page-in overwrites a slot the step in flight may read
        self.num_page_ins = 0  # adapters copied into a device slot so far
        self.num_host_copies = 0  # host copies made so far (read, packed, pinned)
        self.staged_requests: list[tuple[int, LoRARequest]] = []  # the same, for the other tensor-parallel ranks
        logger.info("LoRA: %d target linears, %d slots of rank %d (%.1f MiB on the device)", len(self.targets),
                    max_loras, max_rank, self.pool.num_bytes / 2**20)

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """Every projection an adapter may target, by Hugging Face module name: (in, out) of the whole (unsharded)
        base projection."""
        return module_shapes(self.targets)

    def add(self, request: LoRARequest) -> None:
        """Registers an adapter unless known, after checking its config and tensor shapes (milliseconds: no weight
        is read), and starts making its host copy on the loader thread. ValueError naming it when it cannot serve."""
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if known != request:
                raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                                 f"({known.lora_path}); {request.lora_name!r} needs an id of its own")
            return
        for other in self.known.values():
            if other.lora_name == request.lora_name:
                raise ValueError(f"LoRA adapter name {request.lora_name!r} is already loaded with lora_int_id "
                                 f"{other.lora_int_id}")
        check_header(read_header(request, self.max_rank), self.targets)
        self.known[request.lora_int_id] = request
        self.host.want(request)

    def remove(self, lora_int_id: int) -> None:
        """Forgets an adapter; requests already queued with it still run with it (their pin keeps its host copy
        until they end)."""
        self.known.pop(lora_int_id, None)
        self.host.forget(lora_int_id)

    def pin(self, request: LoRARequest) -> None:
        """A request runs with this adapter: its host copy is made (if it is not there) and kept until unpin."""
        self.host.pin(request)

    def unpin(self, lora_int_id: int) -> None:
        self.host.unpin(lora_int_id)

    def ready(self, request: LoRARequest) -> bool:
        """Whether a pinned adapter's host copy is made (a request may then be scheduled); raises the ValueError
        that making it raised (the adapter is forgotten: a later request checks and reads it anew)."""
        try:
            return self.host.ready(request)
        except Exception:
            self.known.pop(request.lora_int_id, None)
            raise

    def wait_ready(self, timeout: float | None = None) -> None:
        """Blocks until every host copy being made is done (raising the first failure)."""
        self.host.wait(timeout)

    def packed(self, request: LoRARequest) -> PackedAdapter:
        """The host copy of an adapter; made here (on the loop) only where no pin asked for it ahead (the other
        tensor-parallel ranks, which get page-ins from rank 0's message)."""
        adapter = self.host.get(request.lora_int_id)
        return adapter if adapter is not None else self.host.put(self._pack(request))

    def _pack(self, request: LoRARequest) -> PackedAdapter:
        self.num_host_copies += 1
        adapter = load_adapter(request, self.max_rank)
        return pack_adapter(adapter, self.targets, self.max_rank, self.dtype, pin=self.device.type == "cuda")

    def shutdown(self) -> None:
        self.host.shutdown()

    # ---------------------------------------------------------------- per step

    def stage(self, loads: list[tuple[int, LoRARequest]], wait: bool = True) -> None:
        """The scheduler's page-ins for a prepared step (copied in upload()); `wait`: one of them overwrites a slot
        the step in flight may still read."""
        self._staged_wait |= wait and bool(loads)
        self.num_page_ins += len(loads)
        for slot, request in loads:
            self._staged.append((slot, self.packed(request)))
            if self.tp_size > 1:  # rank 0 forwards them (take_staged_message)
                self.staged_requests.append((slot, request))

    def take_staged_message(self) -> bytes | None:
        """The page-ins staged since the last call, as the message rank 0 sends the other ranks (each reads its own
        shards from the adapter's folder); None when there are none."""
        if not self.staged_requests:
            return None
        loads = [(slot, r.lora_name, r.lora_int_id, r.lora_path) for slot, r in self.staged_requests]
        self.staged_requests = []
        return json.dumps(loads).encode()

    def stage_message(self, data: bytes) -> None:
        """A worker: stages the page-ins of rank 0's message for its next step."""
        # Always ordered after the compute in flight: this rank does not know which slots rank 0's step read.
        self.stage([(slot, LoRARequest(name, lora_id, path)) for slot, name, lora_id, path in json.loads(data)])
        self.staged_requests = []

    def upload(self, h2d: torch.cuda.Stream | None, compute: torch.cuda.Stream | None) -> None:
        """Pages the staged adapters into their slots; call on the H2D stream before the step's h2d_done. Where a
        slot being replaced may still be read by the step in flight (its requests finished while it ran: the
        scheduler knows), the copies first wait for everything enqueued on the compute stream so far (a device-side
        wait); a slot idle since before that step was scheduled is copied into at once, under its compute."""
        if not self._staged:
            return
        if self._staged_wait and h2d is not None and compute is not None:
            h2d.wait_stream(compute)
        for slot, adapter in self._staged:
            self.pool.load(slot, adapter)
        self._staged.clear()
        self._staged_wait = False

    @staticmethod
    def write_slots(region: np.ndarray, scheduled: list, num_tokens: int, padded_tokens: int,
                    draft_rows: list[tuple[int, int, int]] | None = None) -> None:
        """A step's per-token adapter slots into its pinned region ([max_num_tokens] int32): each row's slot for
        each of its scheduled tokens, -1 on padding rows. draft_rows (a flat verify step, whose rows are every
        sequence's own row and then each one's drafts: (sequence, first draft row, drafts)): the draft rows take
        their sequence's slot."""
        slots = [s.request.lora_slot for s in scheduled]
        if draft_rows is not None:
            region[:len(scheduled)] = slots
            for i, first, k in draft_rows:
                region[first:first + k] = slots[i]
        elif num_tokens == len(scheduled):
            region[:num_tokens] = slots
        else:
            region[:num_tokens] = np.repeat(slots, [s.num_scheduled_tokens for s in scheduled])
        if padded_tokens > num_tokens:
            region[num_tokens:padded_tokens] = -1
