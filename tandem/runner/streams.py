"""Three non-default CUDA streams (H2D, compute, D2H) and per-slot events; no-ops on the CPU."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class _NullEvent:
    """CPU stand-in for a CUDA event: the work before it has already run, so it records the clock."""

    time = 0.0

    def record(self, stream: object = None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class StepEvents:
    """The events that order one slot's step: h2d_done -> compute -> compute_done -> D2H -> d2h_done."""

    def __init__(self, device: torch.device, timing: bool) -> None:
        self.timing = timing
        self.cuda = cuda = device.type == "cuda"
        make = (lambda t: torch.cuda.Event(enable_timing=t)) if cuda else (lambda t: _NullEvent())
        self.h2d_done = make(False)
        self.mask_done = make(False)  # a constrained step's grammar bitmask is on the device
        self.d2h_done = make(False)
        # compute_start .. compute_done bracket the step's GPU work; timed only for the CPU/GPU timeline.
        self.compute_start = make(timing)
        self.compute_done = make(timing)
        # A constrained step's GPU work has a gap: the forward ends (forward_done), then the sampling waits for
        # the grammar bitmask (sample_start). Recorded only for such steps, so that the gap is not counted busy.
        self.forward_done = make(timing)
        self.sample_start = make(timing)
        self.deferred = False

    def gpu_spans(self, base: tuple[object, float] | None) -> list[tuple[str, float, float]]:
        """(name, start, end) of the step's GPU work on the perf_counter clock (a CUDA `base` event and the clock's
        reading when it fired); call once the step is waited for. One "compute" span, or for a step whose sampling
        waited for a grammar bitmask, "compute" (the forward) and "sample"."""
        if not self.timing:  # recorded before timing was turned on
            return []
        if not self.cuda:
            return [("compute", self.compute_start.time, self.compute_done.time)]  # type: ignore[attr-defined]
        if base is None:
            return []
        base_event, base_time = base

        def at(event: object) -> float:
            return base_time + base_event.elapsed_time(event) / 1000.0  # type: ignore[attr-defined]

        if self.deferred:
            return [("compute", at(self.compute_start), at(self.forward_done)),
                    ("sample", at(self.sample_start), at(self.compute_done))]
        return [("compute", at(self.compute_start), at(self.compute_done))]


class DeviceStreams:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)
            self.compute = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def on(self, which: str) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(getattr(self, which)):
            yield

    def wait(self, which: str, event: object) -> None:
        """Makes stream `which` wait for `event` on the GPU; the CPU does not block."""
        if self.cuda:
            getattr(self, which).wait_event(event)

    def record(self, which: str, event: object) -> None:
        """Records `event` on stream `which` (on the CPU: stamps the clock, the work before it being done)."""
        event.record(getattr(self, which) if self.cuda else None)  # type: ignore[attr-defined]
