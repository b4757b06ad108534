"""Tensor-parallel ranks' lives: creating or joining the group (spawned workers or torchrun) and leaving a process.

Rank 0 (the engine's process) calls start_tensor_parallel with the function each spawned rank runs (the runner's
worker loop, which replays rank 0's steps until it says stop or goes away); under torchrun every process joins.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed.ranks import INIT_TIMEOUT, NCCL_ENV, TensorParallelGroup, torchrun_rank

WorkerMain = Callable[[EngineConfig, TensorParallelGroup], None]  # a spawned rank's life once it joined


class _ProcessGroups:
    """How many tensor-parallel groups this process has made (a fact about the process, not a setting)."""

    def __init__(self) -> None:
        self.count = 0


_MADE = _ProcessGroups()
_NAMES_PER_GROUP = 1000  # torch names a group's process groups from a counter; each tensor-parallel group gets its own range

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    device = config.resolved_device()
    if device.type != "cuda":
        return device
    if config.device.startswith("cuda:"):
        raise ValueError("with tensor_parallel_size > 1 give device 'cuda' or 'auto': rank r uses GPU r of the node")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor-parallel local rank {local_rank} needs GPU {local_rank} but only "
                         f"{torch.cuda.device_count()} are visible")
    return torch.device("cuda", local_rank)


def start_tensor_parallel(config: EngineConfig, worker_main: WorkerMain) -> TensorParallelGroup | None:
    """Joins (torchrun) or creates (spawning ranks 1..N-1, each running worker_main) the tensor-parallel group;
    None for one rank. The caller has checked that the model splits over the ranks."""
    size = config.tensor_parallel_size
    launched = torchrun_rank()
    if launched is None and size == 1:
        return None
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)  # inherited by the spawned workers too
    names_from = _MADE.count * _NAMES_PER_GROUP
    _MADE.count += 1
    procs: list[Any] = []
    if launched is not None:
        rank, world, local_rank = launched
        if world != size:
            raise ValueError(f"torchrun started {world} processes but tensor_parallel_size is {size}: "
                             f"pass --tensor-parallel-size {world}")
        init_method = "env://"
    else:
        if dist.is_initialized():
            raise ValueError("a torch.distributed process group already exists in this process; "
                             "tensor_parallel_size > 1 spawns its own (or launch with torchrun)")
        rank, local_rank = 0, 0
        device = _rank_device(config, local_rank)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, {torch.cuda.device_count()} visible")
        port = _free_port()
        init_method = f"tcp://127.0.0.1:{port}"
        ctx = multiprocessing.get_context("spawn")
        for r in range(1, size):
            proc = ctx.Process(target=_spawned_worker_main,
                               args=(config, r, size, init_method, names_from, worker_main, os.getpid()),
                               name=f"tandem-tp-rank{r}", daemon=True)
            proc.start()
            procs.append(proc)
    device = _rank_device(config, local_rank)
    return _init_group(device, rank, size, init_method, procs, names_from, config.enable_expert_parallel)


def _init_group(device: torch.device, rank: int, size: int, init_method: str, procs: list[Any], names_from: int,
                expert_parallel: bool = False) -> TensorParallelGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # The ranks share the machine's cores; oversubscribed OpenMP pools spin against each other.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # eager NCCL communicator: created before any graph capture
    # torch names process groups "0", "1", ... and counts again from 0 once the default group is destroyed, while
    # its symmetric memory keeps per-name state for the life of the process: every rank of this group starts
    # counting at the same fresh base, so that a later engine of rank 0's process never reuses a name.
    dist.distributed_c10d._world.group_count = names_from
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=INIT_TIMEOUT,
                                **kwargs)
    except Exception:
        for proc in procs:
            proc.kill()
        torch.set_num_threads(threads)
        raise
    return TensorParallelGroup(rank, size, device, procs, threads, expert_parallel)


def _exit_with_parent(parent_pid: int) -> None:
    """A spawned worker must not outlive rank 0 (even one killed with SIGKILL)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="tandem-tp-parent-watch", daemon=True).start()


def _spawned_worker_main(config: EngineConfig, rank: int, size: int, init_method: str, names_from: int,
                         worker_main: WorkerMain, parent_pid: int) -> None:
    _exit_with_parent(parent_pid)
    device = _rank_device(config, rank)
    group = _init_group(device, rank, size, init_method, [], names_from, config.enable_expert_parallel)
    worker_main(config, group)
    exit_worker()


def exit_worker(code: int = 0) -> NoReturn:
    """Ends a worker process without interpreter teardown (where NCCL communicators may hang)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
