"""Tensor-parallel ranks: this process's place among them, its liveness checks, and rank 0's per-step message.

Rank 0 is the engine's own process: it schedules, prepares each step into its pinned slot buffers and
broadcasts a fixed int64 header and those buffers' bytes packed on a CPU gloo group before launching the
step on its own GPU. Ranks 1..N-1 (spawned by launch.py, or started by torchrun) receive the same bytes into
their own slot buffers and launch the same H2D/compute sequence; the model's all-reduces (its TPGroup, group.py)
tie the GPUs together, so rank 0 never waits on another rank's GPU, only on its own d2h_done. A dead worker is seen through its process sentinel; a worker exits when rank 0 goes away. Shutdown
(stop_workers, then close once the CUDA graphs are gone) destroys the groups on every rank, or aborts them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from tandem.config import ParallelConfig
from tandem.distributed.group import TPGroup

logger = logging.getLogger(__name__)

# Set in every process that runs NCCL: no NVLink multicast (NVLS), which these machines must not use.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
INIT_TIMEOUT = timedelta(minutes=10)  # weight loading of a 70B shard can take minutes before the first collective

LEAVE_TIMEOUT_S = 10.0  # a clean leave takes well under a second; past this the process is left as it is
_IDLE_TIMEOUT = timedelta(days=365)
_OP_STEP, _OP_STOP, _OP_REPORT, _OP_ALL_REDUCE_BENCH, _OP_BYTES = 1, 2, 3, 4, 5
STEP_FIELDS = 16  # ints a step's header carries between the op code and the payload's byte count
_HEADER_LEN = STEP_FIELDS + 2


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank is gone: the group cannot run another step."""


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


class TensorParallelGroup:
    """This process's rank, its model's TPGroup (`comm`), the gloo group that carries step messages, and (on rank 0)
    the spawned workers."""

    def __init__(self, rank: int, size: int, device: torch.device, procs: list[Any], saved_num_threads: int,
                 expert_parallel: bool = False) -> None:
        self.parallel = ParallelConfig(rank, size, expert_parallel)
        self.comm = TPGroup(self.parallel)  # the default process group: the model's collectives
        self.device = device
        self.procs = procs  # rank 0 of a spawned group: the workers; else empty
        # Workers block on this group between steps: an idle server must not time them out.
        self.cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        self._header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        self._header_np = self._header.numpy()
        self._stage: torch.Tensor | None = None
        self._stage_np = np.empty(0, dtype=np.uint8)
        self.received = b""  # a worker's last send_bytes message
        self.failure: str | None = None
        self.closed = False
        self._stop_sent = False
        self.saved_num_threads = saved_num_threads  # torch's CPU thread count before this group: restored on close

    @property
    def rank(self) -> int:
        return self.parallel.rank

    @property
    def size(self) -> int:
        return self.parallel.size

    # ---------------------------------------------------------------- liveness

    def check_alive(self) -> None:
        """Raises WorkerDiedError once any spawned worker has exited (cheap: a non-blocking waitpid)."""
        if self.failure is None:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.exitcode is not None:
                    self.failure = f"tensor-parallel worker rank {rank} exited (exit code {proc.exitcode})"
                    break
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def raise_failure(self, exc: Exception) -> NoReturn:
        """A collective or broadcast failed: names the worker that died (given a moment to be reaped) or
        reports the failure; every later step fails with the same error."""
        deadline = time.monotonic() + (2.0 if self.procs else 0.0)
        while True:
            try:
                self.check_alive()
            except WorkerDiedError as died:
                raise died from exc
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        self.failure = f"tensor-parallel collective failed: {type(exc).__name__}: {exc}"
        raise WorkerDiedError(self.failure) from exc

    def wait_event(self, event: Any) -> None:
        """Rank 0's one wait per step, polling so that a dead worker (whose all-reduce never comes) is an
        error instead of a hang. Without spawned workers to watch it is a plain synchronize."""
        if not self.procs:
            event.synchronize()
            return
        while not event.query():
            self.check_alive()
            time.sleep(20e-6)

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t[0])

    # ---------------------------------------------------------------- step messages

    def send_step(self, fields: Sequence[int], regions: list[torch.Tensor]) -> None:
        """Rank 0: a step's header fields, then its filled host regions packed, to every worker (CPU to CPU only)."""
        self.check_alive()
        self._header_np[0] = _OP_STEP
        self._header_np[1:-1] = fields
        stage = self._staging(regions)
        offset = 0
        for region in regions:  # one packed payload: two gloo broadcasts per step in all
            raw = region.numpy().view(np.uint8)
            stage[offset : offset + raw.size] = raw
            offset += raw.size
        self._header_np[-1] = offset
        try:
            dist.broadcast(self._header, src=0, group=self.cpu_group)
            dist.broadcast(self._stage[:offset], src=0, group=self.cpu_group)
        except Exception as exc:
            self.raise_failure(exc)

    def send_bytes(self, data: bytes) -> None:
        """Rank 0, before a step: a message every worker reads as "bytes" from recv_step (then in `received`)."""
        self.check_alive()
        self._header_np[:] = 0
        self._header_np[:2] = (_OP_BYTES, len(data))
        try:
            dist.broadcast(self._header, src=0, group=self.cpu_group)
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.cpu_group)
        except Exception as exc:
            self.raise_failure(exc)

    def recv_step(self) -> np.ndarray | str | None:
        """Worker: the next step's header fields, "report" when rank 0 asks for GPU spans, "bytes" for a message
        from send_bytes (kept in `received`), None when it says stop."""
        dist.broadcast(self._header, src=0, group=self.cpu_group)
        op = int(self._header_np[0])
        if op == _OP_STOP:
            return None
        if op == _OP_REPORT:
            return "report"
        if op == _OP_BYTES:  # a message between steps (LoRA page-ins): its bytes follow
            data = torch.empty(int(self._header_np[1]), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.cpu_group)
            self.received = data.numpy().tobytes()
            return "bytes"
        if op == _OP_ALL_REDUCE_BENCH:
            num_tokens, hidden, count, reps = (int(x) for x in self._header_np[1:5])
            self._all_reduce_loop(num_tokens, hidden, count, reps)
            return "bench"
        return self._header_np[1:-1]

    def measure_all_reduce(self, num_tokens: int, hidden: int, count: int, reps: int = 5) -> float:
        """Rank 0, between steps: milliseconds of `count` back-to-back eager all-reduces of [num_tokens, hidden]
        in the model dtype (a step's worth: 2 per layer + the embedding's), the mean over `reps` rounds."""
        self.check_alive()
        self._header_np[:] = 0
        self._header_np[:5] = (_OP_ALL_REDUCE_BENCH, num_tokens, hidden, count, reps)
        dist.broadcast(self._header, src=0, group=self.cpu_group)
        return self._all_reduce_loop(num_tokens, hidden, count, reps)

    def _all_reduce_loop(self, num_tokens: int, hidden: int, count: int, reps: int) -> float:
        all_reduce = self.comm.all_reduce
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        x = torch.zeros(num_tokens, hidden, dtype=dtype, device=self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for _ in range(3):
            all_reduce(x)
        sync()
        start = time.perf_counter()
        for _ in range(reps * count):
            all_reduce(x)
        sync()
        return (time.perf_counter() - start) * 1e3 / reps

    def collect_spans(self) -> list[tuple[int, int, float, float]]:
        """Rank 0: every worker's recorded (rank, step, start, end) GPU spans since the last call (perf_counter
        clock, which all processes of one machine share). Not per step: after a timed run."""
        self.check_alive()
        self._header_np[:] = 0
        self._header_np[0] = _OP_REPORT
        dist.broadcast(self._header, src=0, group=self.cpu_group)
        spans = []
        for rank in range(1, self.size):
            count = torch.zeros(1, dtype=torch.int64)
            dist.recv(count, src=rank, group=self.cpu_group)
            rows = torch.zeros(int(count[0]), 3, dtype=torch.float64)
            if rows.numel():
                dist.recv(rows, src=rank, group=self.cpu_group)
            spans += [(rank, int(step), start, end) for step, start, end in rows.tolist()]
        return spans

    def send_spans(self, spans: list[tuple[int, float, float]]) -> None:
        """Worker: its (step, start, end) spans to rank 0 (the answer to collect_spans)."""
        dist.send(torch.tensor([len(spans)], dtype=torch.int64), dst=0, group=self.cpu_group)
        if spans:
            dist.send(torch.tensor(spans, dtype=torch.float64), dst=0, group=self.cpu_group)

    def recv_payload(self, regions: list[torch.Tensor]) -> None:
        """Worker: the step's host regions, written in place into this rank's pinned buffers."""
        stage = self._staging(regions)
        size = int(self._header_np[-1])
        dist.broadcast(self._stage[:size], src=0, group=self.cpu_group)
        offset = 0
        for region in regions:
            raw = region.numpy().view(np.uint8)
            raw[:] = stage[offset : offset + raw.size]
            offset += raw.size
        if offset != size:
            raise RuntimeError(f"tensor-parallel step message of {size} bytes, expected {offset}")

    def _staging(self, regions: list[torch.Tensor]) -> np.ndarray:
        """The packed-payload byte buffer (grown to the largest step's regions, so allocated once in practice)."""
        total = sum(r.numel() * r.element_size() for r in regions)
        if self._stage is None or self._stage.numel() < total:
            self._stage = torch.empty(total, dtype=torch.uint8)
            self._stage_np = self._stage.numpy()
        return self._stage_np

    def stop_workers(self) -> None:
        """Rank 0: tells the workers to leave their step loop (they free their graphs and destroy the group
        with this rank, then exit). A no-op once sent, on a failed group or on a worker."""
        if self.rank != 0 or self._stop_sent or self.failure is not None:
            return
        self._stop_sent = True
        try:
            self._header_np[:] = 0
            self._header_np[0] = _OP_STOP
            dist.broadcast(self._header, src=0, group=self.cpu_group)
        except Exception as exc:  # a worker already gone: the group is aborted and the worker reaped in close
            self.failure = f"could not stop the tensor-parallel workers: {type(exc).__name__}: {exc}"
            logger.warning("%s", self.failure)

    def abort(self) -> None:
        """Rank 0 after a failed start: kills the workers and aborts the group."""
        self.failure = self.failure or "tensor-parallel group aborted"
        for proc in self.procs:
            proc.kill()
        self.close()

    def close(self, timeout_s: float = LEAVE_TIMEOUT_S) -> None:
        """Leaves the group and (rank 0) reaps the workers. Call it once this rank's CUDA graphs are released
        and, on rank 0, after stop_workers: a healthy group is destroyed (ncclCommDestroy, which the workers
        call at the same time), a failed one aborted (ncclCommAbort, which needs no peer)."""
        if self.closed:
            return
        self.closed = True
        self.check_alive_quietly()
        self.stop_workers()
        leave_process_group(self.cpu_group, healthy=self.failure is None, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                logger.warning("tensor-parallel worker %s did not exit: killing it", proc.name)
                proc.kill()
                proc.join(5)
        torch.set_num_threads(self.saved_num_threads)

    def check_alive_quietly(self) -> None:
        """Records a dead worker as this group's failure without raising. Once told to stop, a worker that
        exited with code 0 has left the group cleanly: that is no failure."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.exitcode
            if self.failure is None and code is not None and not (self._stop_sent and code == 0):
                self.failure = f"tensor-parallel worker rank {rank} exited (exit code {code})"


def leave_process_group(cpu_group: Any, healthy: bool, timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
    """Destroys this process's groups (the gloo step group, then the default NCCL group), or aborts them
    when a peer is gone; returns whether that finished in timeout_s.

    The caller must have released every CUDA graph that captured NCCL kernels: each holds a reference on
    its communicator, and ncclCommDestroy and ncclCommAbort both wait until those references are gone
    (pytorch issue 115388). ncclCommDestroy also waits for the peers to destroy theirs; ncclCommAbort does
    not. It runs on a helper thread so that a broken peer cannot hang shutdown; a leave that does not
    finish is logged, and the next tensor-parallel engine of this process then fails to start.
    """
    if not dist.is_initialized():
        return True

    def leave() -> None:
        try:
            if healthy:
                dist.destroy_process_group(cpu_group)
                dist.destroy_process_group()
            else:
                dist.distributed_c10d._abort_process_group()
        except Exception:
            logger.warning("leaving the tensor-parallel process group failed", exc_info=True)
            if dist.is_initialized():
                dist.distributed_c10d._abort_process_group()

    thread = threading.Thread(target=leave, name="tandem-tp-leave", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.error("the tensor-parallel process group was not %s in %.0f s (a CUDA graph holding its "
                     "communicator?); a new tensor-parallel engine in this process will not start",
                     "destroyed" if healthy else "aborted", timeout_s)
        return False
    return True
