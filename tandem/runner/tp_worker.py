"""Tensor-parallel ranks' lives: creating or joining the group (spawned workers or torchrun), and a worker's loop.

Rank 0 (the engine's process) calls start_tensor_parallel; ranks 1..N-1 run run_worker, replaying rank 0's
steps through their own ModelRunner until rank 0 says stop or goes away.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from tandem.config import EngineConfig, ParallelConfig
from tandem.layers.parallel import check_tp_shape, set_tp_group
from tandem.models.loader import load_model_config
from tandem.runner.model_runner import ModelRunner
from tandem.runner.tensor_parallel import INIT_TIMEOUT, NCCL_ENV, TensorParallelGroup, torchrun_rank

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


def start_tensor_parallel(config: EngineConfig) -> TensorParallelGroup | None:
    """Joins (torchrun) or creates (spawning ranks 1..N-1) the tensor-parallel group; None for one rank."""
    size = config.tensor_parallel_size
    launched = torchrun_rank()
    if launched is None and size == 1:
        return None
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)  # inherited by the spawned workers too
    # Before any process starts: a model that cannot be split is a ValueError here, not in N processes.
    check_tp_shape(load_model_config(config), ParallelConfig(0, size, config.enable_expert_parallel))
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
            proc = ctx.Process(target=_spawned_worker_main, args=(config, r, size, init_method, os.getpid()),
                               name=f"tandem-tp-rank{r}", daemon=True)
            proc.start()
            procs.append(proc)
    device = _rank_device(config, local_rank)
    return _init_group(device, rank, size, init_method, procs, config.enable_expert_parallel)


def _init_group(device: torch.device, rank: int, size: int, init_method: str, procs: list[Any],
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
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=INIT_TIMEOUT,
                                **kwargs)
    except Exception:
        for proc in procs:
            proc.kill()
        torch.set_num_threads(threads)
        raise
    set_tp_group(None)  # the default group is the tensor-parallel group
    return TensorParallelGroup(rank, size, device, procs, threads, expert_parallel)


def _exit_with_parent(parent_pid: int) -> None:
    """A spawned worker must not outlive rank 0 (even one killed with SIGKILL)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="tandem-tp-parent-watch", daemon=True).start()


def _spawned_worker_main(config: EngineConfig, rank: int, size: int, init_method: str, parent_pid: int) -> None:
    _exit_with_parent(parent_pid)
    device = _rank_device(config, rank)
    group = _init_group(device, rank, size, init_method, [], config.enable_expert_parallel)
    run_worker(config, group)
    exit_worker()


def exit_worker(code: int = 0) -> NoReturn:
    """Ends a worker process without interpreter teardown (where NCCL communicators may hang)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run_worker(config: EngineConfig, group: TensorParallelGroup) -> None:
    """Ranks 1..N-1: build this rank's runner, then replay rank 0's steps until it says stop or goes away."""
    runner = ModelRunner(config, group)
    try:
        while True:
            plan = group.recv_plan()
            if plan is None:
                break
            if plan == "report":
                group.send_spans(runner.take_worker_spans())
                continue
            if plan == "bench":
                continue
            runner.launch_remote(plan)
    except Exception:
        # Rank 0 gone (its socket closed) or this rank failed: rank 0 sees this process exit.
        logger.exception("tensor-parallel rank %d stops", group.rank)
        exit_worker(1)
    # Rank 0 said stop and is doing the same: finish this GPU's work, release the graphs, destroy the group.
    runner.shutdown()
