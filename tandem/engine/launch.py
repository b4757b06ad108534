"""Starts the engine-core process(es), one per data-parallel replica, and stops and reaps them.

Used by `tandem serve` (server/launcher.py) and by `LLM(..., data_parallel_size=M)` (engine/data_parallel.py).
Each replica is a spawned process that loads its model, answers with its EngineInfo (or EngineFailed) on a
pipe, then serves commands over ZeroMQ IPC sockets in a private temporary folder removed at stop.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from tandem.config import EngineConfig, environment
from tandem.engine.messages import AbortClient, ClientCommand, EngineFailed, EngineInfo, Shutdown, StartupReply
from tandem.engine.process import DEFAULT_CORE, run_engine_core

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 1024  # waiting + running requests an engine holds at most; more are refused
ENGINE_STOP_TIMEOUT_S = 30.0


class EngineStartError(RuntimeError):
    """The engine-core process could not load the model (its message says why)."""


@dataclass
class EngineReplica:
    """One engine-core process: a data-parallel replica with its own GPU(s), KV cache and scheduler."""

    process: BaseProcess
    info: EngineInfo
    input_addr: str


@dataclass
class Engines:
    """The running engine-core replica(s) and the addresses the API processes bind for their outputs."""

    replicas: list[EngineReplica]
    output_addrs: list[str]
    ipc_dir: str

    @property
    def input_addrs(self) -> list[str]:
        return [r.input_addr for r in self.replicas]

    @property
    def pids(self) -> list[int]:
        return [r.info.pid for r in self.replicas]

    @property
    def info(self) -> EngineInfo:
        """What the API sees: the smallest context any replica allows, the KV blocks of all of them."""
        infos = [r.info for r in self.replicas]
        return EngineInfo(min(i.max_model_len for i in infos), infos[0].vocab_size,
                          sum(i.num_blocks for i in infos), infos[0].pid, infos[0].lora_modules)

    @property
    def processes(self) -> list[BaseProcess]:
        return [r.process for r in self.replicas]

    def send_all(self, command: ClientCommand, skip: set[int] | frozenset[int] = frozenset()) -> None:
        """Sends one command to every replica but those in `skip` (dead ones)."""
        ctx = zmq.Context()
        for r, replica in enumerate(self.replicas):
            if r not in skip and replica.process.exitcode is None:
                sock = ctx.socket(zmq.PUSH)
                sock.connect(replica.input_addr)
                sock.send(msgspec.msgpack.encode([command]))
                sock.close(linger=1000)
        ctx.term()

    def abort_client(self, client_index: int, skip: set[int] | frozenset[int] = frozenset()) -> None:
        """API process `client_index` died: every replica frees the requests it owned."""
        self.send_all(AbortClient(client_index), skip)

    def stop(self, timeout_s: float = ENGINE_STOP_TIMEOUT_S) -> int | None:
        """Asks every replica to fail what is left and exit; kills any that does not. Returns the worst exit code."""
        self.send_all(Shutdown())
        for replica in self.replicas:  # a stopped (SIGSTOP) replica resumes to take its Shutdown
            if replica.process.exitcode is None and replica.process.pid is not None:
                try:
                    os.kill(replica.process.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        codes = []
        for replica in self.replicas:
            replica.process.join(max(0.0, deadline - time.monotonic()))
            if replica.process.is_alive():
                logger.warning("engine core %d did not stop in %.0f s: killing it", replica.info.pid, timeout_s)
                replica.process.kill()
                replica.process.join(10)
            codes.append(replica.process.exitcode)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        return next((c for c in codes if c != 0), codes[0] if codes else None)


def start_engines(config: EngineConfig, *, num_api_servers: int = 1, data_parallel_size: int = 1,
                  max_queue: int = DEFAULT_MAX_QUEUE, log_level: str = "info",
                  core_class: str = DEFAULT_CORE) -> Engines:
    """Starts data_parallel_size engine-core processes and waits until each has its model loaded.

    Replica r sees only its own GPUs (CUDA_VISIBLE_DEVICES), r * tp .. (r + 1) * tp - 1 of the visible
    ones, so each loads, sizes its KV cache and captures its graphs as if it were alone. Raises
    EngineStartError (after stopping the others) if any replica fails.
    """
    if data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {data_parallel_size}")
    ipc_dir = tempfile.mkdtemp(prefix="tandem-ipc-")
    output_addrs = [f"ipc://{ipc_dir}/output-{i}" for i in range(num_api_servers)]
    ctx = mp.get_context("spawn")  # CUDA cannot be used after fork
    started: list[tuple[BaseProcess, Any, str]] = []
    try:
        for r in range(data_parallel_size):
            input_addr = f"ipc://{ipc_dir}/input-{r}"
            reader, writer = ctx.Pipe(duplex=False)
            # Not a daemon: the engine may start tensor-parallel workers of its own. It exits by itself
            # when the launcher disappears (it watches its parent pid).
            process = ctx.Process(target=run_engine_core, name=f"tandem-engine-core-{r}",
                                  args=(config, input_addr, output_addrs, max_queue, writer, log_level, core_class,
                                        r))
            with environment(replica_env(config, r, data_parallel_size)):
                process.start()
            writer.close()
            started.append((process, reader, input_addr))
        replicas = [EngineReplica(process, _startup_reply(reader, process), input_addr)
                    for process, reader, input_addr in started]
    except BaseException:
        for process, _, _ in started:
            if process.is_alive():
                process.kill()
            process.join(10)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise
    finally:
        for _, reader, _ in started:
            reader.close()
    return Engines(replicas, output_addrs, ipc_dir)


def replica_env(config: EngineConfig, replica: int, data_parallel_size: int) -> dict[str, str]:
    """Environment variables a replica process starts with, beside this process's own.

    On GPUs: CUDA_VISIBLE_DEVICES (its own GPUs) and NVLink multicast off (values set here win). On the
    CPU: an equal share of the cores, since the replicas' OpenMP pools would otherwise spin against each other.
    """
    if data_parallel_size == 1:
        return {}
    tp = config.tensor_parallel_size
    if not _uses_cuda(config):
        if "OMP_NUM_THREADS" in os.environ:
            return {}
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // (data_parallel_size * tp)))}
    from tandem.distributed.ranks import NCCL_ENV

    env = {key: value for key, value in NCCL_ENV.items() if key not in os.environ}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(_cuda_device_count())]
    if data_parallel_size * tp > len(ids):
        raise ValueError(f"data_parallel_size x tensor_parallel_size needs {data_parallel_size * tp} GPUs; "
                         f"{len(ids)} are visible")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[replica * tp:(replica + 1) * tp])
    return env


def _uses_cuda(config: EngineConfig) -> bool:
    if config.device == "cpu":
        return False
    if config.device == "auto":
        import torch

        return torch.cuda.is_available()
    return True


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _startup_reply(reader: Any, process: BaseProcess) -> EngineInfo:
    wait_any([reader, process.sentinel])
    try:
        reply = msgspec.msgpack.decode(reader.recv_bytes(), type=StartupReply)
    except (EOFError, OSError):
        process.join(10)
        raise EngineStartError(f"the engine core process exited (code {process.exitcode}) before it was ready")
    if isinstance(reply, EngineFailed):
        raise EngineStartError(reply.message)
    return reply
