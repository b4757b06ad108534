"""Programmatic dependent launch (PDL) for the Triton kernels on Hopper and later GPUs.

A kernel launched with `launch_pdl` may be scheduled while the kernel before it in the stream is still running:
its programs become resident on SMs the other kernel leaves free, run up to `pdl_wait`, and continue the moment
that kernel has finished, instead of the next grid being launched only then (~1 us per kernel boundary, ~300
boundaries in a Llama-2-7B decode step). A kernel lets its successor launch as soon as all of its own programs
have started (PDL_EARLY, the default: they signal before waiting) or have passed their wait (PDL_LATE,
TANDEM_PDL=late), so a GEMV two kernels down the stream can be streaming its first weights during the tail of
the one running, past the tiny norm or reduce kernel between them. Either way, by the time a kernel passes
`pdl_wait` every kernel before it in the stream has finished: its predecessor has, and that one passed its own
wait only after its predecessor had.

The contract for a kernel body: before `pdl_wait` it may read only what no kernel of the step writes (weights,
norm scales), and it writes nothing. The weight-streaming GEMV uses that to load its first weight tile early,
the small-M tile GEMM to prefetch its first weight tiles into L2 (`prefetch_l2`, which has no effect on values).
TANDEM_PDL=0 turns it off (read per launch, so a CUDA graph keeps what its capture saw).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl


PDL_OFF, PDL_LATE, PDL_EARLY = 0, 1, 2  # a kernel's USE_PDL: how it lets the next kernel launch


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    # Waits until the previous kernel in the stream has finished and its writes are visible, and lets the
    # next kernel launch (before waiting: PDL_EARLY; after: PDL_LATE). A no-op without PDL.
    if USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif USE_PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    # Asks for the lines at `ptrs` (where mask) to be brought into L2; values are unaffected, so it may run
    # before pdl_wait on any address. One instruction per element: pass one pointer per 128-byte line.
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        constraints="=r,l,r", args=[ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, for the kernels' shape-only tile heuristics."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # interpreter runs: pretend an H100 so the heuristic is exercised the same way


@functools.lru_cache(maxsize=None)
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(device: torch.device) -> int:
    """How Triton kernels on `device` launch: with PDL (PDL_EARLY; TANDEM_PDL=late: PDL_LATE) on CUDA GPUs of
    compute capability >= 9.0, unless TANDEM_PDL=0 (PDL_OFF). Never PDL in the interpreter (CPU tensors).
    Launch with `launch_pdl=bool(mode)` and pass the mode as the kernel's USE_PDL."""
    setting = os.environ.get("TANDEM_PDL")
    if device.type != "cuda" or setting == "0":
        return PDL_OFF
    if not _has_pdl(device.index if device.index is not None else torch.cuda.current_device()):
        return PDL_OFF
    return PDL_LATE if setting == "late" else PDL_EARLY


_persistent: dict[tuple[str, str, int | None], tuple[int, Any]] = {}


def persistent_state(name: str, device: torch.device, size: int, make: Callable[[int], Any], min_capacity: int) -> Any:
    """State a kernel keeps from one launch to the next (counters, maxima), one per (name, device):
    make(capacity) with capacity >= size, made anew only when a launch needs more and never during CUDA-graph
    capture (the runner's warm-up runs every shape eagerly before capturing it; a capture that would need
    more raises). `name` says whose state it is in that error."""
    key = (name, device.type,
           torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index)
    entry = _persistent.get(key)
    if entry is None or entry[0] < size:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{name} must be allocated before CUDA-graph capture: run the same shape once "
                               "eagerly first")
        capacity = max(size, min_capacity)
        entry = (capacity, make(capacity))
        _persistent[key] = entry
    return entry[1]
