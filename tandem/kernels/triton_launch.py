"""Programmatic dependent launch (PDL) for the Triton kernels on Hopper and later GPUs.

A kernel launched with `launch_pdl` may be scheduled while the kernel before it in the stream is still running:
its programs become resident on SMs the other kernel leaves free, run up to `pdl_wait`, and continue the moment
that kernel has finished, instead of the next grid being launched only then (~1 us per kernel boundary, ~300
boundaries in a Llama-2-7B decode step). Each kernel lets its successor launch as soon as all of its own
programs have passed their wait, so at most two kernels overlap, and by the time a kernel passes `pdl_wait`
every kernel before it in the stream has finished.

The contract for a kernel body: before `pdl_wait` it may read only what no kernel of the step writes (weights,
norm scales), and it writes nothing. The weight-streaming GEMV uses that to load its first weight tile early.
TANDEM_PDL=0 turns it off (read per launch, so a CUDA graph keeps what its capture saw).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    # Waits until the previous kernel in the stream has finished and its writes are visible, then lets the
    # next kernel launch. A no-op when the kernel was not launched with PDL.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether Triton kernels on `device` launch with PDL: CUDA GPUs of compute capability >= 9.0, unless
    TANDEM_PDL=0. Never in the interpreter (CPU tensors)."""
    if device.type != "cuda" or os.environ.get("TANDEM_PDL") == "0":
        return False
    return _has_pdl(device.index if device.index is not None else torch.cuda.current_device())
