"""Low-latency all-reduce for decode-sized messages: one kernel of peer-to-peer loads over torch symmetric memory.

NCCL's ring all-reduce costs ~16-19 us a call inside a CUDA graph on two NVLink GPUs, whatever the message
size up to a few hundred KiB; a decode step of a 7B model makes 64 of them. Here every rank keeps one buffer
in symmetric memory (mapped into every peer's address space, no NVLink multicast), and an all-reduce is
torch's `symm_mem` one-shot kernel (copy the local input in, barrier, each rank sums all peers' buffers in
rank order: deterministic) for small messages, or its two-shot kernel (reduce-scatter + all-gather over the
same buffer) for medium ones. Larger messages (prefill chunks) and anything the buffer cannot take go to NCCL.
Both kernels capture into CUDA graphs. The thresholds are per world size and can be tuned by environment
variables; scripts/bench_all_reduce.py measures every path beside NCCL.

Where a row-parallel product goes straight into the residual add and RMSNorm (o_proj, down_proj and the MoE
block of every decoder layer), `add_rms_norm` does all three in one Triton kernel for one-shot-sized messages
(tandem/kernels/triton_all_reduce.py): each rank writes its rows into its peers' inboxes and reads its own, with
one flag per row and peer and no second barrier. On two H200s it takes 4.6 us at 8 KiB where the one-shot
all-reduce and the norm kernel after it take 9.0 (scripts/bench_all_reduce.py). TANDEM_FUSED_ALL_REDUCE_NORM=0
keeps the two kernels.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import torch

from tandem.kernels.fp8 import PartialSums

logger = logging.getLogger(__name__)

Path = Literal["one_shot", "two_shot", "nccl"]

# Bytes up to which each path is taken, by world size (beyond: the next path; beyond two-shot: NCCL).
# One-shot moves (world - 1) x the message per rank over NVLink, two-shot 2 x (world - 1) / world x it in two
# rounds: one-shot wins while the message is small enough that its single round's latency dominates. Two H200s
# (2026-11-28, scripts/bench_all_reduce.py): one-shot 12.3 us against two-shot's 14.2 at 512 KiB, 15.0 against
# 16.4 at 1 MiB (and the fused add + RMSNorm kernel, which takes one-shot sizes, 9.4 us at 1 MiB). Four H200s
# (2026-11-28): one-shot 11.0 us against two-shot's 14.2 at 256 KiB, 18.9 against 17.6 at 1 MiB.
ONE_SHOT_MAX_BYTES = {2: 1 << 20, 4: 256 << 10, 8: 64 << 10}
TWO_SHOT_MAX_BYTES = {2: 4 << 20, 4: 4 << 20, 8: 4 << 20}
_ALIGN = 16  # the symm_mem kernels load 16 bytes at a time: input and buffer must agree on it
FUSED_FLAGS = 4096  # int64 flags of the fused kernel: rows x world size at most


def choose_path(num_bytes: int, world_size: int, one_shot_max: int | None = None,
                two_shot_max: int | None = None) -> Path:
    """The all-reduce path for a message of num_bytes over world_size ranks (thresholds above unless given)."""
    one = ONE_SHOT_MAX_BYTES.get(world_size, 0) if one_shot_max is None else one_shot_max
    two = TWO_SHOT_MAX_BYTES.get(world_size, 0) if two_shot_max is None else two_shot_max
    if num_bytes <= one:
        return "one_shot"
    if num_bytes <= two:
        return "two_shot"
    return "nccl"


def _env_bytes(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value is None else int(value)


class SymmetricAllReduce:
    """The peer-to-peer all-reduce of one tensor-parallel group (CUDA, 2-8 ranks), with one buffer of max_bytes.

    Calling it returns the sum in a new tensor, or None where the caller must use NCCL (too large, another
    dtype, not contiguous or not 16-byte aligned). Created collectively: every rank must construct it at the
    same point (rendezvous).
    """

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.world_size = dist.get_world_size(group)
        self.group_name: str = group.group_name
        self.dtype = dtype
        self.one_shot_max = _env_bytes("TANDEM_ONE_SHOT_MAX_BYTES") or ONE_SHOT_MAX_BYTES.get(self.world_size, 0)
        self.two_shot_max = _env_bytes("TANDEM_TWO_SHOT_MAX_BYTES") or TWO_SHOT_MAX_BYTES.get(self.world_size, 0)
        self.max_bytes = min(max_bytes, max(self.one_shot_max, self.two_shot_max))
        numel = -(-self.max_bytes // dtype.itemsize)
        self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)  # [numel] this rank's share of the mapping
        _rendezvous(self.buffer, self.group_name)
        self.rank = dist.get_rank(group)
        self.fused = os.environ.get("TANDEM_FUSED_ALL_REDUCE_NORM", "1") != "0" and self.one_shot_max > 0
        if self.fused:  # the fused kernel's inbox, flags and per-row call counts, zero on every rank before use
            self.plane = -(-min(self.one_shot_max, self.max_bytes) // dtype.itemsize)  # elements of one message
            self.max_rows = FUSED_FLAGS // self.world_size
            self.inbox = symm_mem.empty(2 * self.world_size * self.plane, dtype=dtype, device=device)
            self.flags = symm_mem.empty(self.max_rows * self.world_size, dtype=torch.int64, device=device).zero_()
            ptrs = [_rendezvous(t, self.group_name).buffer_ptrs for t in (self.inbox, self.flags)]
            self.inbox_ptrs = torch.tensor(ptrs[0], dtype=torch.int64, device=device)  # [world] each rank's inbox
            self.flag_ptrs = torch.tensor(ptrs[1], dtype=torch.int64, device=device)  # [world] each rank's flags
            self.epochs = torch.zeros(self.max_rows, dtype=torch.int64, device=device)
            self.timed_out = torch.zeros(1, dtype=torch.int32, device=device)  # set by a wait that gave up
            torch.cuda.synchronize(device)
            dist.barrier(group=group)

    def path(self, x: torch.Tensor) -> Path:
        num_bytes = x.numel() * x.element_size()
        if (x.dtype != self.dtype or num_bytes > self.max_bytes or not x.is_contiguous()
                or x.data_ptr() % _ALIGN):
            return "nccl"
        return choose_path(num_bytes, self.world_size, self.one_shot_max, self.two_shot_max)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        path = self.path(x)
        return None if path == "nccl" else self.run(x, path)

    def fuses(self, rows: int, dim: int, dtype: torch.dtype) -> bool:
        """Whether add_rms_norm takes a [rows, dim] message of dtype (one shot's size, the fused kernel's rows)."""
        return (self.fused and 0 < rows <= self.max_rows and rows * dim <= self.plane and dtype == self.dtype
                and choose_path(rows * dim * dtype.itemsize, self.world_size, self.one_shot_max,
                                self.two_shot_max) == "one_shot")

    def add_rms_norm(self, x: torch.Tensor | PartialSums, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(sum(x) + residual) * weight, sum(x) + residual) by the fused kernel, or None where it does
        not apply (the caller all-reduces, then norms): too large for one shot, another dtype or layout. x may
        be a split-K GEMM's PartialSums, which the kernel adds up itself (no reduce kernel)."""
        if isinstance(x, PartialSums):
            laid_out = x.ws.is_contiguous()
        else:
            laid_out = x.is_contiguous() and x.data_ptr() % _ALIGN == 0
        rows, dim = x.shape if len(x.shape) == 2 else (0, 0)
        if (not laid_out or not self.fuses(rows, dim, x.dtype) or weight.dtype != x.dtype
                or (residual is not None and residual.shape != (rows, dim))):
            return None
        from tandem.kernels.triton_all_reduce import all_reduce_add_rms_norm_triton  # lazy: CUDA only

        return all_reduce_add_rms_norm_triton(
            x, residual.contiguous() if residual is not None else None, weight, eps, self.inbox_ptrs, self.plane,
            self.flag_ptrs, self.epochs, self.timed_out, self.rank, self.world_size)

    def run(self, x: torch.Tensor, path: Path) -> torch.Tensor:
        """The sum of x by one of the peer-to-peer kernels (x must fit the buffer); a new tensor."""
        staging = self.buffer[:x.numel()].view_as(x)
        out = torch.empty_like(x)
        if path == "one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, out)
        else:
            staging.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staging, "sum", self.group_name, out)
        return out


def create_symmetric_all_reduce(group: Any, device: torch.device, dtype: torch.dtype,
                                max_bytes: int) -> SymmetricAllReduce | None:
    """The peer-to-peer all-reduce for this group, or None (NCCL everywhere) where it cannot run: not CUDA,
    TANDEM_ALL_REDUCE=nccl, a world size the kernels do not take, a group name used before, or no
    symmetric memory (no P2P access, an older torch). Collective: every rank calls it at the same point and
    gets the same answer."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if (device.type != "cuda" or os.environ.get("TANDEM_ALL_REDUCE", "auto") == "nccl"
            or world not in ONE_SHOT_MAX_BYTES or dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        return None
    # torch keeps symmetric-memory state per process group name, and numbers its exchanges per process, for the
    # life of the process: a name must not come back (tandem names each tensor-parallel group's process groups
    # afresh, launch.py; a name seen before takes NCCL), and the ranks' counts are aligned first. So a second
    # engine in one process gets the peer-to-peer path too. All ranks agree before any allocation.
    name = str(group.group_name)
    fresh = torch.tensor([0.0 if name in _STATE.group_names else 1.0], device=device)
    dist.all_reduce(fresh, op=dist.ReduceOp.MIN, group=group)
    if not bool(fresh.item()):  # start-up only: one host read
        logger.info("process group %r used symmetric memory before in this process: NCCL for every message", name)
        return None
    _STATE.group_names.add(name)
    try:
        if not _align_exchanges(group, device):
            raise RuntimeError("the ranks' symmetric-memory exchange counts cannot be aligned")
        comm = SymmetricAllReduce(group, device, dtype, max_bytes)
        ok = torch.ones(1, device=device)
    except Exception as exc:  # every rank must agree: a rank that failed tells the others below
        logger.warning("peer-to-peer all-reduce unavailable (%s): NCCL for every message", exc)
        comm, ok = None, torch.zeros(1, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return comm if bool(ok.item()) else None


def _rendezvous(tensor: torch.Tensor, group_name: str) -> Any:
    """torch's rendezvous of a fresh symmetric allocation, counted (see _align_exchanges)."""
    import torch.distributed._symmetric_memory as symm_mem

    handle = symm_mem.rendezvous(tensor, group_name)
    _STATE.rendezvous += 1
    return handle


def _align_exchanges(group: Any, device: torch.device) -> bool:
    """Brings every rank's count of symmetric-memory rendezvous to the highest, so that the next ones meet.

    torch numbers the store exchanges of its rendezvous with one counter per process, and a rank's keys only meet
    its peers' at the same number. The workers of a second tensor-parallel engine are fresh processes, while rank 0
    has counted the first engine's rendezvous: the ranks behind (all by the same count, or this gives up) run that
    many rendezvous of a small allocation among themselves, which advances their counter as rank 0's advanced.
    Collective over `group`; False where the counts cannot be aligned."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.tensor([_STATE.rendezvous], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(counts, mine, group=group)
    values = [int(c.item()) for c in counts]  # start-up only: host reads
    top = max(values)
    behind = [r for r in range(world) if values[r] < top]
    if not behind:
        return True
    if len({values[r] for r in behind}) > 1:
        return False
    lagging = dist.new_group([dist.get_global_rank(group, r) for r in behind])  # every rank makes it
    if rank in behind:
        for _ in range(top - values[rank]):
            probe = symm_mem.empty(16, dtype=torch.uint8, device=device)
            _rendezvous(probe, lagging.group_name)
            del probe
    dist.barrier(group=group)
    return True


class _ProcessState:
    """What this process has done with torch's symmetric memory (a fact about the process, not a setting)."""

    def __init__(self) -> None:
        self.group_names: set[str] = set()  # process groups that rendezvoused symmetric memory
        self.rendezvous = 0  # rendezvous of fresh allocations, each a fixed number of torch's store exchanges


_STATE = _ProcessState()
