"""The device side of LoRA: a fixed pool of max_loras slots per target linear (stacked A and B), the static
per-token slot index every linear reads, and the delta each target linear adds to its base output."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.lora import (LoRAShrunk, SlotGroups, index_token_slots, lora_add_beside, lora_counters,
                                 lora_shrink, slot_groups)
from tandem.layers.linear import Linear
from tandem.lora.pack import PackedAdapter, num_parts


class LoRADelta:
    """What a target Linear holds as `.lora`: its slice of the pool and the shared token index. Linear.forward adds
    the delta onto its base output (`add_beside`; before a row-parallel layer's all-reduce: A's input columns are
    sharded like the base weight, so the ranks' partial deltas sum with the partial products)."""

    __slots__ = ("a", "b", "token_slots", "counters", "side", "groups", "parts")

    def __init__(self, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                 counters: torch.Tensor | None = None, side: SideStream | None = None,
                 groups: SlotGroups | None = None, parts: int = 1) -> None:
        self.a = a  # [max_loras, parts * max_rank, in_local]
        self.b = b  # [max_loras, out_local, parts * max_rank], the adapter's scale folded in
        self.token_slots = token_slots  # [max_num_tokens] int32, -1: no adapter
        self.counters = counters  # the kernels' split counters, one buffer for the pool (None: off the GPU)
        self.side = side  # the stream the shrink runs on beside the base projection, with its counters (GPU)
        self.groups = groups  # the step's tokens grouped by slot, shared by the pool (None: the one-block kernels)
        self.parts = parts  # the linear's fused parts, each on its own max_rank columns of A and B

    def add_beside(self, x: torch.Tensor, base: Callable[[], torch.Tensor | PartialSums],
                   gated: bool = False) -> torch.Tensor | PartialSums:
        """base() (the base projection of x, or its split-K partial sums) plus each token's delta, the shrink beside
        base() on the GPU; gated (the gate/up projection): silu(gate) * up of that."""
        side = self.side
        return lora_add_beside(x, base, self.a, self.b, self.token_slots, self.counters if side is None else
                               side.counters, None if side is None else side.stream, self.groups,
                               self.parts if gated else 0)

    def shrink(self, x: torch.Tensor) -> LoRAShrunk:
        """x [n, in_local]'s rank columns through each token's A, with B and the slots: what the epilogue of a
        decode kernel (the GEMV, the skinny tile GEMM) reads to add the delta itself (Linear._fused_lora)."""
        return LoRAShrunk(lora_shrink(x, self.a, self.token_slots, self.counters, self.groups), self.b,
                          self.token_slots)


@dataclass(slots=True)
class SideStream:
    """The stream LoRA shrinks run on beside the base projections, and its own split counters."""

    stream: torch.cuda.Stream
    counters: torch.Tensor


class LoRAPool:
    """max_loras slots of every target linear, zero until an adapter pages in; attaches a LoRADelta to each
    target. The token index is one static tensor: each step's forward first copies its slot buffers' per-token
    slots into it (select), so captured graphs replay any mix of adapters without recapture; a decode step also
    groups its tokens by slot there, once, for every projection's kernels (groups). On a GPU the shrinks run on
    a side stream beside the base projections; TANDEM_LORA_SIDE_STREAM=0 keeps them on the main stream (on an
    H200, 2026-11-29, 32 rows over 8 adapters: a 6,490 us step against 5,738 with the side stream)."""

    def __init__(self, targets: dict[str, Linear], max_loras: int, max_rank: int, max_num_tokens: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras = max_loras
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.counters = lora_counters(max_loras, device)
        self.groups = slot_groups(max_loras, max_num_tokens, device)
        side = (SideStream(torch.cuda.Stream(device), lora_counters(max_loras, device))
                if device.type == "cuda" and os.environ.get("TANDEM_LORA_SIDE_STREAM") != "0" else None)
        self.slots: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, linear in targets.items():
            parts = num_parts(name)
            cols = parts * max_rank
            a = torch.zeros(max_loras, cols, linear.in_features, dtype=dtype, device=device)
            b = torch.zeros(max_loras, linear.out_features, cols, dtype=dtype, device=device)
            self.slots[name] = (a, b)
            linear.lora = LoRADelta(a, b, self.token_slots, self.counters, side, self.groups, parts)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.slots.values())

    def load(self, slot: int, adapter: PackedAdapter) -> None:
        """Copies a packed adapter into `slot` (non-blocking from pinned memory: call on the H2D stream, ordered
        after every step that may still read the slot); linears it leaves alone get zeros there."""
        for name, (a, b) in self.slots.items():
            pair = adapter.weights.get(name)
            if pair is None:
                a[slot].zero_()
                b[slot].zero_()
            else:
                a[slot].copy_(pair[0], non_blocking=True)
                b[slot].copy_(pair[1], non_blocking=True)

    def select(self, step_slots: torch.Tensor) -> None:
        """The step's per-token slots (a slot buffer's device region, [num_tokens]) into the static index, and at
        decode sizes grouped by slot (index_token_slots)."""
        index_token_slots(step_slots, self.token_slots, self.groups)
