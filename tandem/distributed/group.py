"""TPGroup: the tensor-parallel group a model's layers communicate in, and the path each collective takes in it.

A model is built with the TPGroup of its rank (a one-rank group when unsharded) and its parallel layers call the
group's collectives: nothing is looked up in module state, so two engines of one process (one after the other, or
side by side on gloo) each run in their own group. A group starts on NCCL (or gloo on the CPU); once its runner knows
the largest decode message, `enable_peer_to_peer` rendezvouses the symmetric-memory buffers of the peer-to-peer
all-reduce (all_reduce.py) and small messages take it from then on. `release` drops them with the CUDA graphs that
captured them.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from tandem.config import ParallelConfig
from tandem.distributed.all_reduce import SymmetricAllReduce, create_symmetric_all_reduce
from tandem.kernels.fp8 import PartialSums
from tandem.kernels.ops import reduce_partial_sums

logger = logging.getLogger(__name__)


class Unreduced(NamedTuple):
    """This rank's part of a row-parallel product whose cross-rank sum is left to the RMSNorm after it, which
    fuses it with the residual add and the norm where it can (TPGroup.add_rms_norm). The part may still be a
    split-K GEMM's partial sums, which that kernel adds up too."""

    partial: torch.Tensor | PartialSums
    group: TPGroup

    def reduce(self) -> torch.Tensor:
        partial = self.partial
        return self.group.all_reduce(reduce_partial_sums(partial) if isinstance(partial, PartialSums) else partial)


class TPGroup:
    """Rank `parallel.rank` of `parallel.size`, its process group (None: the default group) and, once enabled, its
    peer-to-peer all-reduce. With one rank every collective is the identity and nothing touches torch.distributed."""

    def __init__(self, parallel: ParallelConfig | None = None, process_group: Any = None) -> None:
        self.parallel = parallel or ParallelConfig()
        self.process_group = process_group
        self.p2p: SymmetricAllReduce | None = None

    @property
    def rank(self) -> int:
        return self.parallel.rank

    @property
    def size(self) -> int:
        return self.parallel.size

    @property
    def expert_parallel(self) -> bool:
        return self.parallel.expert_parallel

    # ---------------------------------------------------------------- lifecycle

    def enable_peer_to_peer(self, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        """Collective (every rank at the same point, before any graph capture): messages of up to max_bytes go peer
        to peer from now on where this machine can (CUDA, 2-8 ranks, symmetric memory), larger ones to NCCL."""
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        self.p2p = create_symmetric_all_reduce(group, device, dtype, max_bytes)
        if self.p2p is not None:
            logger.info("peer-to-peer all-reduce up to %d KiB (one-shot up to %d KiB), NCCL above",
                        self.p2p.max_bytes >> 10, self.p2p.one_shot_max >> 10)

    @property
    def timed_out(self) -> torch.Tensor | None:
        """[1] int32 on the device, set (sticky) by a fused all-reduce that gave up waiting for a peer; None where
        no such kernel runs."""
        return self.p2p.timed_out if self.p2p is not None and self.p2p.fused else None

    def release(self) -> None:
        """Drops the symmetric-memory buffers (after the CUDA graphs that captured them); NCCL from now on."""
        self.p2p = None

    # ---------------------------------------------------------------- collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks: decode-sized messages through the peer-to-peer kernels (a new tensor),
        others through NCCL, in place. Either captures into CUDA graphs."""
        if self.size == 1:
            return x
        if self.p2p is not None:
            out = self.p2p(x)
            if out is not None:
                return out
        dist.all_reduce(x, group=self.process_group)
        return x

    def defers_all_reduce(self) -> bool:
        """Whether all_reduce_or_defer may leave the all-reduce to the norm (the fused peer-to-peer kernel is on)."""
        return self.p2p is not None and self.p2p.fused

    def all_reduce_or_defer(self, x: torch.Tensor | PartialSums) -> torch.Tensor | Unreduced:
        """For an output that goes straight into the residual add and RMSNorm: x as Unreduced where the fused
        kernel could take its all-reduce there, else the all-reduced x."""
        unreduced = Unreduced(x, self)
        return unreduced if self.defers_all_reduce() and len(x.shape) == 2 else unreduced.reduce()

    def add_rms_norm(self, x: Unreduced, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(norm(sum + residual) * weight, sum + residual) in one kernel, or None (reduce x, then norm it)."""
        return self.p2p.add_rms_norm(x.partial, residual, weight, eps) if self.p2p is not None else None

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[n, d] per rank -> [n, size * d], rank r's columns at [r * d, (r + 1) * d)."""
        size = self.size
        if x.device.type == "cuda":
            out = torch.empty(size, *x.shape, dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.process_group)
        else:  # gloo: the list form
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x.contiguous(), group=self.process_group)
            out = torch.stack(parts)
        return out.permute(1, 0, 2).reshape(x.shape[0], size * x.shape[1])

    def warm_nccl(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """NCCL connects a communicator's peers on its first collectives of each size class: runs one of each up to
        numel elements so that no request's step waits for that. Every rank calls it at the same point."""
        x = torch.zeros(numel, dtype=dtype, device=device)
        size = 1 << 14
        while True:
            dist.all_reduce(x[: min(size, numel)], group=self.process_group)
            if size >= numel:
                break
            size *= 8
        if device.type == "cuda":
            torch.cuda.synchronize(device)
