"""`tandem serve`: starts the engine-core process and the API process(es), and takes them all down together.

Processes: the launcher (this one) starts one engine-core process, waits for its EngineInfo, then runs the
API server itself (`--api-server-count 1`) or starts N API processes that share the port through
SO_REUSEPORT. Engine and API processes talk over ZeroMQ IPC sockets in a private temporary folder that
the launcher removes at exit. Any process dying takes the server down with a non-zero exit status;
SIGTERM drains the API processes, then stops the engine, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from tandem.config import EngineConfig, environment, relax_gc
from tandem.server.engine_core import DEFAULT_CORE, run_engine_core
from tandem.server.messages import EngineFailed, EngineInfo, Shutdown, StartupReply

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 1024
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
ENGINE_DEATH_EXIT_DELAY_S = 2.0  # /health answers 503 this long after the engine died, then the server exits 1
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
                          sum(i.num_blocks for i in infos), infos[0].pid)

    @property
    def processes(self) -> list[BaseProcess]:
        return [r.process for r in self.replicas]

    def stop(self, timeout_s: float = ENGINE_STOP_TIMEOUT_S) -> int | None:
        """Asks every replica to fail what is left and exit; kills any that does not. Returns the worst exit code."""
        ctx = zmq.Context()
        for replica in self.replicas:
            if replica.process.is_alive():
                sock = ctx.socket(zmq.PUSH)
                sock.connect(replica.input_addr)
                sock.send(msgspec.msgpack.encode([Shutdown()]))
                sock.close(linger=1000)
        ctx.term()
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
    from tandem.runner.tensor_parallel import NCCL_ENV

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


# ---- one API server ----------------------------------------------------------------------------


@dataclass
class ApiSettings:
    """Everything an API process needs, picklable for process start (not used on the request path)."""

    engine_config: EngineConfig
    model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    graceful_timeout: float = 30.0
    log_level: str = "info"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineEndpoints:
    """What one API process needs to reach the engine replicas (picklable, for the API processes' start)."""

    info: EngineInfo
    input_addrs: list[str]
    pids: list[int]
    output_addr: str

    @classmethod
    def of(cls, engines: Engines, client_index: int) -> EngineEndpoints:
        return cls(engines.info, engines.input_addrs, engines.pids, engines.output_addrs[client_index])


def build_api_server(settings: ApiSettings, endpoints: EngineEndpoints,
                     client_index: int = 0) -> tuple[Any, Any, list[str]]:
    """(uvicorn.Server, app, death messages) of one API process."""
    import uvicorn

    from tandem.models.loader import load_tokenizer
    from tandem.server.app import build_app
    from tandem.server.async_engine import AsyncEngine

    info = endpoints.info
    died: list[str] = []
    server: uvicorn.Server | None = None

    def on_engine_death(message: str) -> None:
        died.append(message)
        # Keep answering /health with 503 for a moment (monitors see why), then exit non-zero.
        asyncio.get_running_loop().call_later(ENGINE_DEATH_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True))

    async_engine = AsyncEngine(endpoints.input_addrs, endpoints.output_addr, client_index=client_index,
                               max_queue=settings.max_queue, engine_pids=endpoints.pids,
                               on_engine_death=on_engine_death, block_size=settings.engine_config.block_size)
    app = build_app(async_engine, load_tokenizer(settings.engine_config), model_names=settings.model_names,
                    max_model_len=info.max_model_len, vocab_size=info.vocab_size, api_key=settings.api_key)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, timeout_graceful_shutdown=settings.graceful_timeout, lifespan="on",
                            loop=_available("uvloop", "auto"), http=_available("httptools", "auto"))
    server = uvicorn.Server(config)
    return server, app, died


def _available(module: str, fallback: str) -> str:
    try:
        __import__(module)
    except ImportError:
        return fallback
    return module


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other API processes can bind too: the kernel spreads connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _api_process_main(settings: ApiSettings, endpoints: EngineEndpoints, client_index: int,
                      sock: socket.socket) -> None:
    """Body of API process i of N (N > 1), serving on its own SO_REUSEPORT socket (bound by the launcher)."""
    set_process_name(f"tandem-api-{client_index}")
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s api-{client_index}: %(message)s")
    server, _, died = build_api_server(settings, endpoints, client_index)
    _run_quietly_on_signal(server, sockets=[sock])
    raise SystemExit(1 if died or not server.started else 0)


# ---- the launcher -----------------------------------------------------------------------------------


def serve(settings: ApiSettings, num_api_servers: int = 1, data_parallel_size: int = 1,
          core_class: str = DEFAULT_CORE) -> int:
    """Runs the whole server until SIGTERM/SIGINT (exit 0) or until any of its processes dies (exit 1)."""
    if num_api_servers < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {num_api_servers}")
    if settings.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {settings.max_queue}")
    metrics_dir = None
    if num_api_servers > 1:
        metrics_dir = tempfile.mkdtemp(prefix="tandem-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by the API processes at import
    try:
        engines = start_engines(settings.engine_config, num_api_servers=num_api_servers,
                                data_parallel_size=data_parallel_size, max_queue=settings.max_queue,
                                log_level=settings.log_level, core_class=core_class)
    except EngineStartError as exc:
        logger.error("tandem serve: the engine could not start: %s", exc)
        return 1
    for replica in engines.replicas:
        logger.info("engine core ready (pid %d): max_model_len %d, %d KV blocks", replica.info.pid,
                    replica.info.max_model_len, replica.info.num_blocks)
    try:
        if num_api_servers == 1:
            return _serve_in_process(settings, engines)
        return _serve_with_api_processes(settings, engines, num_api_servers)
    finally:
        code = engines.stop()
        logger.info("engine core stopped (exit code %s)", code)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def _serve_in_process(settings: ApiSettings, engines: Engines) -> int:
    server, _, died = build_api_server(settings, EngineEndpoints.of(engines, 0))
    _run_quietly_on_signal(server)
    if died:
        logger.error("tandem serve: %s", died[0])
        return 1
    return 0 if server.started else 1


def _run_quietly_on_signal(server: Any, sockets: list[socket.socket] | None = None) -> None:
    # uvicorn re-raises the signal it caught through the handler that was installed before it ran;
    # a no-op one there makes a graceful SIGTERM end in exit status 0 instead of death by signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    freeze_gc()
    profile_dir = os.environ.get("TANDEM_PROFILE_API_DIR")  # `tandem bench --serve-profile` sets it
    profiler = None
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        server.run(sockets=sockets)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(os.path.join(profile_dir, f"api-{os.getpid()}.prof"))
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def freeze_gc() -> None:
    """Moves everything allocated at start-up (modules, tokenizer, model objects) out of the collector's
    reach: a full collection then walks only what requests allocate, not a pause of tens of ms; and
    collects young objects in larger, rarer batches from now on (config.GC_GEN0_THRESHOLD)."""
    gc.collect()
    gc.freeze()
    relax_gc()


def set_process_name(name: str) -> None:
    """Names this process for ps/top and /proc/<pid>/comm (Linux; best effort)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _serve_with_api_processes(settings: ApiSettings, engines: Engines, count: int) -> int:
    # Every API process's socket is bound and listening before any of them starts: the kernel spreads
    # connections over all N from the first one (a socket's backlog waits for its process). Were each process
    # to bind its own when ready, the first ones up would take every early connection, and kept-alive
    # connections would keep that skew for the whole run.
    try:
        socks = [reuse_port_socket(settings.host, settings.port) for _ in range(count)]
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return 1
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_api_process_main, name=f"tandem-api-{i}",
                         args=(settings, EngineEndpoints.of(engines, i), i, socks[i]))
             for i in range(count)]
    try:
        for proc in procs:
            proc.start()  # the child gets its own descriptor of socks[i] at spawn
    finally:
        for sock in socks:
            sock.close()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    failed = False
    try:
        while not stop.is_set():
            engine_sentinels = [p.sentinel for p in engines.processes]
            gone = wait_any([*engine_sentinels, *(p.sentinel for p in procs)], timeout=0.2)
            if gone:
                failed = True
                who = "an engine core" if set(gone) & set(engine_sentinels) else "an API process"
                logger.error("tandem serve: %s exited; shutting down", who)
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_api_processes(procs, settings.graceful_timeout)
    return 1 if failed or any(p.exitcode not in (0, None) for p in procs) else 0


def _stop_api_processes(procs: list[BaseProcess], graceful_timeout: float) -> None:
    from prometheus_client import multiprocess

    for proc in procs:
        if proc.is_alive():
            proc.terminate()  # SIGTERM: uvicorn stops accepting and lets open requests finish
    deadline = time.monotonic() + graceful_timeout + 10
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and proc.pid is not None:
            multiprocess.mark_process_dead(proc.pid)


# ---- command line -------------------------------------------------------------------------------------


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`tandem serve` flags: the server's own, then the engine's (shared with `tandem generate`)."""
    from tandem.cli import add_engine_args

    g = parser.add_argument_group("server")
    g.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $TANDEM_API_KEY)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="API processes (HTTP, tokenization, detokenization, SSE) sharing the port; one engine core")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas, each on its own GPU(s) (x --tensor-parallel-size), behind the same API")
    g.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="waiting + running requests at most; more get HTTP 429")
    g.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are cut")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(parser)
    parser.add_argument("--no-overlap", dest="sync", action="store_true", help="the same as --sync")


def model_names_from_args(args: argparse.Namespace) -> list[str]:
    """The served name first (--served-model-name, else the model's base name), then the --model string."""
    if args.model is None:
        names = [args.served_model_name or DEFAULT_MODEL_NAME]
    else:
        base = os.path.basename(os.path.normpath(args.model))
        names = [args.served_model_name or base, args.model]
    return list(dict.fromkeys(names))


def serve_main(args: argparse.Namespace) -> int:
    """`tandem serve`: exit 0 after a graceful SIGTERM/SIGINT shutdown, 1 if the engine or a process failed."""
    from tandem.cli import engine_kwargs

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_process_name("tandem-serve")
    try:
        settings = ApiSettings(EngineConfig(**engine_kwargs(args)), model_names_from_args(args), host=args.host,
                               port=args.port, api_key=args.api_key, max_queue=args.max_queue,
                               graceful_timeout=args.graceful_timeout, log_level=args.log_level)
        code = serve(settings, num_api_servers=args.api_server_count, data_parallel_size=args.data_parallel_size)
    except ValueError as exc:
        raise SystemExit(f"tandem serve: {exc}") from exc
    if code == 0:
        logger.info("tandem serve: shut down cleanly")
    return code
