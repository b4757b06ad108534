"""`tandem serve`: starts the engine-core process and the API process(es), and takes them all down together.

Processes: the launcher (this one) starts the engine-core process(es), one per data-parallel replica, waits
for their EngineInfo, then runs the API server itself (`--api-server-count 1`) or starts N API processes that
share the port through SO_REUSEPORT. Engine and API processes talk over ZeroMQ IPC sockets in a private
temporary folder that the launcher removes at exit.

Failure: a replica that dies (or hangs) is taken out by every API process while the others serve; the server
exits 1 once every replica has died. An API process that dies is replaced on its own listening socket (the
launcher keeps it open, so its connections wait in the backlog meanwhile) after every replica has freed its
requests; more than MAX_API_RESTARTS restarts within API_RESTART_WINDOW_S end the server with exit status 1.
SIGTERM drains the API processes, then stops the engines, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any
from multiprocessing.process import BaseProcess
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.client import DEFAULT_ENGINE_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S
from tandem.engine.launch import DEFAULT_MAX_QUEUE, Engines, EngineStartError, start_engines
from tandem.engine.messages import EngineInfo
from tandem.engine.process import DEFAULT_CORE, HEARTBEAT_S
from tandem.engine.router import SharedLoad
from tandem.engine_args import add_engine_args, engine_kwargs
from tandem.process_utils import freeze_gc, set_process_name
from tandem.server.adapters import AdapterTable, ServedAdapters
from tandem.server.limits import HttpLimits, add_limit_args, limits_from_args
from tandem.server.security import add_security_args

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
ENGINE_DEATH_EXIT_DELAY_S = 2.0  # /health answers 503 this long after the last replica died, then the server exits 1
MAX_API_RESTARTS = 5  # API process restarts allowed within API_RESTART_WINDOW_S; one more ends the server
API_RESTART_WINDOW_S = 60.0


# ---- one API server ----------------------------------------------------------------------------


@dataclass
class ApiSettings:
    """Everything an API process needs, picklable for process start (not used on the request path)."""

    engine_config: EngineConfig
    model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    tool_call_parser: str | None = None  # None: chosen from the model's chat template
    max_queue: int = DEFAULT_MAX_QUEUE
    graceful_timeout: float = 30.0
    log_level: str = "info"
    engine_timeout: float | None = DEFAULT_ENGINE_TIMEOUT_S  # a replica silent this long is taken out
    engine_step_timeout: float | None = DEFAULT_STEP_TIMEOUT_S  # ... and one whose loop is stuck this long
    limits: HttpLimits = field(default_factory=HttpLimits)
    public_metrics: bool = False  # /metrics without the API key
    allowed_origins: list[str] = field(default_factory=list)  # CORS: none unless given
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> PEFT folder, served from the start
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineEndpoints:
    """What one API process needs to reach the engine replicas (picklable, for the API processes' start)."""

    info: EngineInfo
    input_addrs: list[str]
    pids: list[int]
    output_addr: str
    dead_replicas: list[int] = field(default_factory=list)  # replicas that died before this API process started
    shared_load: SharedLoad | None = None  # every API process's work per replica (several API processes and replicas)

    @classmethod
    def of(cls, engines: Engines, client_index: int, dead_replicas: set[int] | None = None,
           shared_load: SharedLoad | None = None) -> EngineEndpoints:
        return cls(engines.info, engines.input_addrs, engines.pids, engines.output_addrs[client_index],
                   sorted(dead_replicas or ()), shared_load)


def load_tokenizer_soon(config: EngineConfig) -> Future:
    """Starts loading the API's tokenizer on a thread of its own, to run while the engine processes start (each
    takes seconds; the engines are spawned, so the thread is never forked): -> its Future."""
    from tandem.models.loader import load_tokenizer

    result: Future = Future()

    def load() -> None:
        try:
            result.set_result(load_tokenizer(config))
        except BaseException as exc:  # handed to whoever waits for it
            result.set_exception(exc)

    threading.Thread(target=load, name="tandem-tokenizer", daemon=True).start()
    return result


def build_api_server(settings: ApiSettings, endpoints: EngineEndpoints,
                     client_index: int = 0, api_restarts: int = 0,
                     tokenizer: Future | None = None,
                     adapter_table: AdapterTable | None = None) -> tuple[Any, Any, list[str]]:
    """(uvicorn.Server, app, death messages) of one API process; `tokenizer`: its tokenizer being loaded
    (load_tokenizer_soon), else it is loaded here; `adapter_table`: the adapters every API process serves (several
    API processes with LoRA on)."""
    import uvicorn

    from tandem.engine.client import AsyncEngine
    from tandem.models.loader import load_tokenizer
    from tandem.server.app import build_app
    from tandem.server.limits import bounded_uvicorn_config

    info = endpoints.info
    died: list[str] = []
    server: uvicorn.Server | None = None

    def on_engine_death(message: str) -> None:  # every replica is dead
        died.append(message)
        # Keep answering /health with 503 for a moment (monitors see why), then exit non-zero.
        asyncio.get_running_loop().call_later(ENGINE_DEATH_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True))

    async_engine = AsyncEngine(endpoints.input_addrs, endpoints.output_addr, client_index=client_index,
                               max_queue=settings.max_queue, engine_pids=endpoints.pids,
                               on_engine_death=on_engine_death, block_size=settings.engine_config.block_size,
                               engine_timeout=settings.engine_timeout, step_timeout=settings.engine_step_timeout,
                               dead_replicas=endpoints.dead_replicas, shared_load=endpoints.shared_load)
    adapters = ServedAdapters(settings.engine_config.enable_lora, settings.model_names, info.lora_modules,
                              settings.engine_config.max_lora_rank, adapter_table)
    adapters.serve_from_start(settings.lora_modules)  # ValueError naming an adapter: the server does not start
    loaded = tokenizer.result() if tokenizer is not None else load_tokenizer(settings.engine_config)
    app = build_app(async_engine, loaded, model_names=settings.model_names,
                    max_model_len=info.max_model_len, vocab_size=info.vocab_size, api_key=settings.api_key,
                    api_restarts=api_restarts, tool_call_parser=settings.tool_call_parser,
                    public_metrics=settings.public_metrics, allowed_origins=settings.allowed_origins,
                    adapters=adapters)
    config = bounded_uvicorn_config(app, settings.limits, app.state.metrics.count_rejected, host=settings.host,
                                    port=settings.port, log_level=settings.log_level, access_log=False,
                                    timeout_graceful_shutdown=settings.graceful_timeout, lifespan="on",
                                    loop=_available("uvloop", "auto"))
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
                      sock: socket.socket, api_restarts: int = 0, adapter_table: AdapterTable | None = None) -> None:
    """Body of API process i of N (N > 1), serving on its own SO_REUSEPORT socket (bound by the launcher)."""
    set_process_name(f"tandem-api-{client_index}")
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s api-{client_index}: %(message)s")
    server, _, died = build_api_server(settings, endpoints, client_index, api_restarts,
                                       adapter_table=adapter_table)
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
    if settings.engine_timeout is not None and not settings.engine_timeout >= 2 * HEARTBEAT_S:
        raise ValueError(f"--engine-timeout must be at least {2 * HEARTBEAT_S:g} seconds (an idle engine sends a "
                         f"heartbeat every {HEARTBEAT_S:g} s), got {settings.engine_timeout}")
    if settings.engine_step_timeout is not None and not settings.engine_step_timeout >= 2 * HEARTBEAT_S:
        raise ValueError(f"--engine-step-timeout must be at least {2 * HEARTBEAT_S:g} seconds, got "
                         f"{settings.engine_step_timeout}")
    metrics_dir = None
    if num_api_servers > 1:
        metrics_dir = tempfile.mkdtemp(prefix="tandem-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by the API processes at import
    # One API process here: its tokenizer loads while the engines start.
    tokenizer = load_tokenizer_soon(settings.engine_config) if num_api_servers == 1 else None
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
        if tokenizer is not None:
            return _serve_in_process(settings, engines, tokenizer)
        return _serve_with_api_processes(settings, engines, num_api_servers)
    finally:
        code = engines.stop()
        logger.info("engine core stopped (exit code %s)", code)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def _serve_in_process(settings: ApiSettings, engines: Engines, tokenizer: Future) -> int:
    server, _, died = build_api_server(settings, EngineEndpoints.of(engines, 0), tokenizer=tokenizer)
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


def _serve_with_api_processes(settings: ApiSettings, engines: Engines, count: int) -> int:
    # Every API process's socket is bound and listening before any of them starts: the kernel spreads
    # connections over all N from the first one (a socket's backlog waits for its process). Were each process
    # to bind its own when ready, the first ones up would take every early connection, and kept-alive
    # connections would keep that skew for the whole run. The launcher keeps its descriptors until shutdown:
    # a replacement API process serves the same socket, and the connections the kernel hashed to it wait in
    # its backlog while it starts instead of being refused.
    try:
        socks = [reuse_port_socket(settings.host, settings.port) for _ in range(count)]
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return 1
    ctx = mp.get_context("spawn")
    dead_engines: set[int] = set()
    num_restarts = 0
    # With several replicas each API process routes by every API process's load, not only its own.
    shared_load = SharedLoad(count, len(engines.replicas)) if len(engines.replicas) > 1 else None
    # With adapters every API process serves the same ones: a run-time load or unload reaches them all.
    adapter_folder = tempfile.mkdtemp(prefix="tandem-adapters-") if settings.engine_config.enable_lora else None
    table = AdapterTable(adapter_folder, settings.lora_modules) if adapter_folder is not None else None

    def start_api(i: int) -> BaseProcess:
        endpoints = EngineEndpoints.of(engines, i, dead_engines, shared_load)
        proc = ctx.Process(target=_api_process_main, name=f"tandem-api-{i}",
                           args=(settings, endpoints, i, socks[i], num_restarts, table))
        proc.start()  # the child gets its own descriptor of socks[i] at spawn
        return proc

    procs: list[BaseProcess] = []
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    failed = False
    restart_times: list[float] = []
    try:
        procs = [start_api(i) for i in range(count)]
        while not stop.is_set() and not failed:
            engine_of = {p.sentinel: r for r, p in enumerate(engines.processes) if r not in dead_engines}
            api_of = {p.sentinel: i for i, p in enumerate(procs)}
            gone = wait_any([*engine_of, *api_of], timeout=0.2)
            for sentinel in gone:
                if sentinel in engine_of:
                    r = engine_of[sentinel]
                    dead_engines.add(r)
                    logger.error("tandem serve: engine replica %d (pid %d) exited; %d of %d replicas left", r,
                                 engines.replicas[r].info.pid, len(engines.replicas) - len(dead_engines),
                                 len(engines.replicas))
            if len(dead_engines) == len(engines.replicas):
                logger.error("tandem serve: every engine replica has exited; shutting down")
                failed = True
                break
            for sentinel in gone:
                if sentinel not in api_of or stop.is_set():
                    continue
                i = api_of[sentinel]
                dead = procs[i]
                dead.join(5)
                now = time.monotonic()
                restart_times = [t for t in restart_times if now - t < API_RESTART_WINDOW_S]
                if len(restart_times) >= MAX_API_RESTARTS:
                    logger.error("tandem serve: API process %d exited (code %s) after %d restarts within %.0f s; "
                                 "shutting down", i, dead.exitcode, len(restart_times), API_RESTART_WINDOW_S)
                    failed = True
                    break
                logger.error("tandem serve: API process %d (pid %s) exited with code %s; replacing it", i, dead.pid,
                             dead.exitcode)
                engines.abort_client(i, skip=dead_engines)  # its open requests have no reader left
                _mark_metrics_dead(dead)
                restart_times.append(now)
                num_restarts += 1
                procs[i] = start_api(i)
                logger.info("tandem serve: API process %d replaced (pid %s; %d restarts so far)", i, procs[i].pid,
                            num_restarts)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sock in socks:  # new connections are refused from here on, once the API processes close theirs
            sock.close()
        _stop_api_processes(procs, settings.graceful_timeout)
        if adapter_folder is not None:
            shutil.rmtree(adapter_folder, ignore_errors=True)
    return 1 if failed or any(p.exitcode not in (0, None) for p in procs) else 0


def _mark_metrics_dead(proc: BaseProcess) -> None:
    """Drops a gone API process's live gauges from the multiprocess metrics (its counters stay counted)."""
    from prometheus_client import multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and proc.pid is not None:
        multiprocess.mark_process_dead(proc.pid)


def _stop_api_processes(procs: list[BaseProcess], graceful_timeout: float) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()  # SIGTERM: uvicorn stops accepting and lets open requests finish
    deadline = time.monotonic() + graceful_timeout + 10
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        _mark_metrics_dead(proc)


# ---- command line -------------------------------------------------------------------------------------


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`tandem serve` flags: the server's own, then the engine's (shared with `tandem generate`)."""
    g = parser.add_argument_group("server")
    g.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $TANDEM_API_KEY)")
    g.add_argument("--api-server-count", type=int, default=None,
                   help="API processes (HTTP, tokenization, detokenization, SSE) sharing the port (default: one per "
                        "data-parallel replica)")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas, each on its own GPU(s) (x --tensor-parallel-size), behind the same API")
    g.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="waiting + running requests at most; more get HTTP 429")
    g.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are cut")
    g.add_argument("--engine-timeout", type=float, default=DEFAULT_ENGINE_TIMEOUT_S,
                   help="seconds an engine replica's process may stay silent (stopped, frozen) before its open "
                        "requests fail and it is taken out; it rejoins when it speaks again")
    g.add_argument("--engine-step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                   help="seconds one engine step may run (deadlocked, stuck in a kernel, or just long: the first "
                        "steps compile kernels) before the replica's open requests fail and it is taken out")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders or Hugging Face Hub ids) served from the start, each under its "
                        "name as `model` (needs --enable-lora); an entry may also be vLLM's JSON "
                        '\'{"name": NAME, "path": PATH, "base_model_name": MODEL}\'')
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="the model's tool-call format (default: chosen from its chat template)")
    add_limit_args(g)
    add_security_args(g)
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


def lora_modules_from_args(items: list[str], enabled: bool, model_names: list[str] | None = None) -> dict[str, str]:
    """`--lora-modules` entries as {name: path}: `name=path`, or vLLM's JSON form `{"name": ..., "path": ...,
    "base_model_name": ...}` (base_model_name, where given, must be a name the base model is served under);
    ValueError for a malformed or repeated entry."""
    if items and not enabled:
        raise ValueError("--lora-modules needs --enable-lora")
    modules: dict[str, str] = {}
    for item in items:
        name, path = _lora_module(item, model_names)
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def _lora_module(item: str, model_names: list[str] | None) -> tuple[str, str]:
    usage = f'--lora-modules takes NAME=PATH or {{"name": NAME, "path": PATH}} entries, got {item!r}'
    if not item.lstrip().startswith("{"):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(usage)
        return name, path
    try:
        spec = json.loads(item)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{usage}: not JSON ({exc.msg})") from None
    name, path = spec.get("name"), spec.get("path")
    if (not isinstance(name, str) or not name or not isinstance(path, str) or not path
            or set(spec) - {"name", "path", "base_model_name"}):
        raise ValueError(usage)
    base = spec.get("base_model_name")
    if base is not None and model_names is not None and base not in model_names:
        raise ValueError(f"--lora-modules {name!r}: base_model_name {base!r} is not a name of the served model "
                         f"({', '.join(map(repr, model_names))})")
    return name, path


def serve_main(args: argparse.Namespace) -> int:
    """`tandem serve`: exit 0 after a graceful SIGTERM/SIGINT shutdown, 1 if the engine or a process failed."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_process_name("tandem-serve")
    if args.grammar_backend:  # the API processes check specs with the engine's backend: they inherit it from here
        os.environ["TANDEM_STRUCTURED_BACKEND"] = args.grammar_backend
    try:
        settings = ApiSettings(EngineConfig(**engine_kwargs(args)), model_names_from_args(args), host=args.host,
                               port=args.port, api_key=args.api_key, max_queue=args.max_queue,
                               graceful_timeout=args.graceful_timeout, log_level=args.log_level,
                               engine_timeout=args.engine_timeout, engine_step_timeout=args.engine_step_timeout,
                               tool_call_parser=args.tool_call_parser, limits=limits_from_args(args),
                               public_metrics=args.public_metrics, allowed_origins=args.allowed_origin or [],
                               lora_modules=lora_modules_from_args(args.lora_modules, args.enable_lora,
                                                                   model_names_from_args(args)))
        # The front end grows with the replicas: two replicas behind one API process's event loop stream
        # at that loop's pace, not at the GPUs'.
        num_api_servers = args.api_server_count if args.api_server_count is not None else args.data_parallel_size
        code = serve(settings, num_api_servers=num_api_servers, data_parallel_size=args.data_parallel_size)
    except ValueError as exc:
        raise SystemExit(f"tandem serve: {exc}") from exc
    if code == 0:
        logger.info("tandem serve: shut down cleanly")
    return code
