"""The engine-core process: one EngineCore in a busy loop that drains commands, steps, and sends outputs.

The loop never waits for an API process: commands are drained without blocking while there is work, and
outputs go out on PUSH sockets with no high-water mark, one message per API process per step.

Heartbeat: every API process hears from this process at least every HEARTBEAT_S, from a thread of its own
(an empty batch carrying `stalled_s`, how long ago the loop last went round), besides the loop's own
messages (stats every STATS_INTERVAL_S while busy, an empty batch each second while idle). Two signs, two
limits in the API processes: silence (the whole process stopped or frozen) past --engine-timeout, and a
loop stalled (a step deadlocked or stuck in a kernel, or merely very long) past --engine-step-timeout. A
thread cannot tell a stuck step from a long one, so the second limit is the longer one: the first steps
after start compile kernels and can take tens of seconds.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from tandem.config import EngineConfig
from tandem.engine.messages import (
    AbortClient,
    AbortRequest,
    AddRequest,
    ClientCommand,
    EngineBatch,
    EngineFailed,
    EngineInfo,
    Rejection,
    Shutdown,
    UnloadLoRA,
    stats_to_wire,
)
from tandem.outputs import EngineOutput
from tandem.process_utils import freeze_gc, set_process_name
from tandem.request import FinishReason

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05  # how stale the stats in the API processes may get while the engine is busy
PARENT_CHECK_S = 1.0  # how often an idle or busy engine checks that its launcher is still alive
HEARTBEAT_S = 1.0  # an API process hears from this engine at least this often, busy or idle
DEFAULT_CORE = "tandem.engine.core:EngineCore"
TIMELINE_ENV = "TANDEM_ENGINE_TIMELINE"  # a Chrome-trace path: the engine core records its timeline into it


class EngineCoreLoop:
    """Serves one EngineCore over ZeroMQ: a bound PULL for every API process's commands, one PUSH per API process."""

    def __init__(self, core: Any, input_addr: str, output_addrs: list[str], max_queue: int,
                 ctx: zmq.Context | None = None, engine_index: int = 0, heartbeat: bool = True) -> None:
        self.core = core
        self.engine_index = engine_index
        self.max_queue = max_queue
        self._ctx = ctx or zmq.Context.instance()
        self._input = self._ctx.socket(zmq.PULL)
        self._input.bind(input_addr)
        self._outputs: list[zmq.Socket] = []
        for addr in output_addrs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block the engine on a slow reader
            # Each API process binds its own output address; connecting from here makes the pipe
            # exist at once, so outputs queue even before (or after) that process is listening.
            sock.connect(addr)
            self._outputs.append(sock)
        self._decoder = msgspec.msgpack.Decoder(list[ClientCommand])
        self._encoder = msgspec.msgpack.Encoder()
        self._encoder_for_beats = msgspec.msgpack.Encoder()  # the heartbeat thread's own
        self._client_of: dict[str, int] = {}  # live request id -> the API process that owns it
        self._batches = [self._new_batch() for _ in output_addrs]
        self._changed = True  # something happened since the last stats went out
        self._last_stats = 0.0
        self._parent_pid = os.getppid()
        self._turned_at = time.monotonic()  # when the loop last went round (read by the heartbeat thread)
        self._stop_beating = threading.Event()
        self._beater: threading.Thread | None = None
        if heartbeat:
            self._beater = threading.Thread(target=self._beat, args=(list(output_addrs),), daemon=True,
                                            name=f"tandem-heartbeat-{engine_index}")
            self._beater.start()
        self._last_parent_check = time.monotonic()

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                self._turned_at = time.monotonic()
                busy = self.core.has_unfinished_requests()
                with self._phase("receive" if busy else None):  # an idle wait is no phase of a step
                    commands = self._receive(block=not busy)
                    stop = self._apply(commands)
                if stop:
                    break
                if self.core.has_unfinished_requests():
                    self._step()
                    fatal = getattr(self.core, "fatal_error", None)
                    if fatal:  # e.g. a dead tensor-parallel rank: every later step would fail too
                        raise SystemExit(f"the engine cannot step any more: {fatal}")
                with self._phase("send"):
                    self._flush()
            self._fail_live("the server is shutting down")
            self._flush(force_stats=True)
        except BaseException as exc:  # a bug outside step(): fail everyone rather than leave them hanging
            logger.exception("engine core loop died")
            self._fail_live(f"engine core died: {exc!r}")
            self._flush(force_stats=True)
            raise
        finally:
            self.close()

    def _phase(self, name: str | None) -> AbstractContextManager[None]:
        """A span of the core's timeline when one is recording (`tandem bench --serve-timeline`)."""
        timeline = getattr(self.core, "timeline", None)
        return timeline.span(name) if timeline is not None and name is not None else nullcontext()

    def close(self) -> None:
        self._stop_beating.set()
        if self._beater is not None:
            self._beater.join(5)
        for sock in (self._input, *self._outputs):
            sock.close(linger=1000)

    def _receive(self, block: bool) -> list[ClientCommand]:
        commands: list[ClientCommand] = []
        if block:
            while not self._input.poll(int(HEARTBEAT_S * 1000)):
                self._turned_at = time.monotonic()  # an idle wait is no stall
                self._check_parent()
                self._heartbeat()
        else:
            now = time.monotonic()
            if now - self._last_parent_check >= PARENT_CHECK_S:
                self._last_parent_check = now
                self._check_parent()
        while True:
            try:
                frame = self._input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return commands
            try:
                commands.extend(self._decoder.decode(frame.buffer))
            except msgspec.DecodeError:
                logger.exception("dropping an undecodable command message")

    def _check_parent(self) -> None:
        if os.getppid() != self._parent_pid:
            raise SystemExit("the launcher process is gone; the engine core exits")

    def _apply(self, commands: list[ClientCommand]) -> bool:
        """Applies adds and aborts in arrival order; returns True on Shutdown."""
        for command in commands:
            self._changed = True
            if isinstance(command, AddRequest):
                self._add(command)
            elif isinstance(command, AbortRequest):
                if self._client_of.pop(command.request_id, None) is not None:
                    try:
                        self.core.abort_request(command.request_id, FinishReason(command.reason),
                                                command.stop_reason)
                    except Exception:
                        logger.exception("abort_request(%s) failed", command.request_id)
            elif isinstance(command, UnloadLoRA):
                self.core.remove_lora(command.lora_int_id)
            elif isinstance(command, AbortClient):
                self._abort_client(command.client_index)
            elif isinstance(command, Shutdown):
                return True
        return False

    def _abort_client(self, client: int) -> None:
        """API process `client` died: its requests have no reader left; free them (a new process starts clean)."""
        owned = sorted(rid for rid, c in self._client_of.items() if c == client)
        for rid in owned:
            del self._client_of[rid]
            try:
                self.core.abort_request(rid, FinishReason.ABORT)
            except Exception:
                logger.exception("abort_request(%s) failed", rid)
        if 0 <= client < len(self._batches):
            self._batches[client] = self._new_batch()
        if owned:
            logger.warning("API process %d is gone: aborted its %d open requests", client, len(owned))

    def _add(self, command: AddRequest) -> None:
        rid, client = command.request_id, command.client_index
        batch = self._batches[client]
        if len(self._client_of) >= self.max_queue:
            batch.rejected.append(Rejection(rid, f"the server is at capacity ({len(self._client_of)} of "
                                                 f"{self.max_queue} requests); retry later", 429))
            return
        try:
            if command.lora_request is None:
                self.core.add_request(rid, command.prompt_token_ids, command.params)
            else:
                self.core.add_request(rid, command.prompt_token_ids, command.params, command.lora_request)
        except ValueError as exc:
            batch.rejected.append(Rejection(rid, str(exc), 400))
            return
        except Exception as exc:
            logger.exception("add_request(%s) failed", rid)
            batch.outputs.append(_failed(rid, f"the engine could not add the request: {exc!r}"))
            return
        self._client_of[rid] = client
        batch.accepted.append(rid)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:
            # The core could not say which requests the step held, so all it holds are failed and
            # aborted: the core comes back empty and consistent, and the loop goes on serving.
            logger.exception("engine step failed")
            self._fail_live(f"engine step failed: {exc!r}")
            return
        self._changed = True
        for out in outputs:
            client = self._client_of.get(out.request_id)
            if client is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._client_of[out.request_id]
            self._batches[client].outputs.append(out)

    def _fail_live(self, message: str) -> None:
        live, self._client_of = self._client_of, {}
        for rid, client in sorted(live.items()):
            try:
                self.core.abort_request(rid, FinishReason.ABORT)
            except Exception:
                logger.exception("abort_request(%s) failed while failing it", rid)
            self._batches[client].outputs.append(_failed(rid, message))

    def _flush(self, force_stats: bool = False) -> None:
        now = time.monotonic()
        idle = not self.core.has_unfinished_requests()
        stats = None
        if force_stats or now - self._last_stats >= STATS_INTERVAL_S or (idle and self._changed):
            try:
                stats = stats_to_wire(self.core.stats())
            except Exception:
                logger.exception("EngineCore.stats() failed")
            self._last_stats, self._changed = now, False
        for client, batch in enumerate(self._batches):
            if stats is None and not (batch.outputs or batch.accepted or batch.rejected):
                continue
            batch.stats = stats
            try:
                self._outputs[client].send(self._encoder.encode(batch), zmq.NOBLOCK, copy=False)
            except zmq.Again:
                logger.error("API process %d is not reachable: dropping a batch of %d outputs", client,
                             len(batch.outputs))
            self._batches[client] = self._new_batch()

    def _beat(self, output_addrs: list[str]) -> None:
        """The heartbeat thread: every HEARTBEAT_S, an empty batch with the loop's stall time to every API
        process, on sockets of its own (a ZeroMQ socket belongs to one thread)."""
        socks = []
        for addr in output_addrs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(addr)
            socks.append(sock)
        try:
            while not self._stop_beating.wait(HEARTBEAT_S):
                beat = self._encoder_for_beats.encode(
                    EngineBatch([], [], [], None, self.engine_index, max(0.0, time.monotonic() - self._turned_at)))
                for sock in socks:
                    try:
                        sock.send(beat, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
        finally:
            for sock in socks:
                sock.close(linger=0)

    def _heartbeat(self) -> None:
        """An idle engine's sign of life: an empty batch to every API process."""
        beat = self._encoder.encode(self._new_batch())
        for sock in self._outputs:
            try:
                sock.send(beat, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def _new_batch(self) -> EngineBatch:
        return EngineBatch([], [], [], None, self.engine_index)


def lora_modules_of(core: Any) -> dict[str, list[int]]:
    """The engine's adapter targets for EngineInfo ({} without LoRA, or for an engine core class without it)."""
    lora = getattr(getattr(core, "runner", None), "lora", None)
    if lora is None:
        return {}
    return {name: list(dims) for name, dims in lora.module_shapes().items()}


def _failed(request_id: str, message: str) -> EngineOutput:
    return EngineOutput(request_id, [], None, True, FinishReason.ABORT, None, 0, 0, error=message)


# ---- process entry ---------------------------------------------------------------------------------


def timeline_path(path: str, engine_index: int) -> str:
    """Replica r > 0 of a data-parallel server writes PATH.r."""
    return f"{path}.{engine_index}" if engine_index else path


def write_timeline(core: Any, path: str, engine_index: int) -> None:
    try:
        timeline = core.stop_timeline()
        if timeline is not None:
            timeline.to_chrome_trace(timeline_path(path, engine_index), label=f"tandem-engine-{engine_index}")
    except Exception:
        logger.exception("could not write the engine timeline to %s", path)


def load_core_class(path: str) -> Any:
    """'package.module:Name' -> the class (the server's tests pass a subclass that can be told to fail)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def run_engine_core(config: EngineConfig, input_addr: str, output_addrs: list[str], max_queue: int,
                    startup: Connection, log_level: str = "INFO", core_class: str = DEFAULT_CORE,
                    engine_index: int = 0) -> None:
    """Body of the engine-core process: load the engine, report EngineInfo (or EngineFailed), serve."""
    # Ctrl-C reaches the whole process group; the launcher decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_process_name(f"tandem-engine-{engine_index}" if engine_index else "tandem-engine")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s engine-core: %(message)s")
    encoder = msgspec.msgpack.Encoder()
    try:
        core = load_core_class(core_class)(config)
        loop = EngineCoreLoop(core, input_addr, output_addrs, max_queue, engine_index=engine_index)
    except BaseException as exc:
        message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        logger.exception("the engine could not start")
        startup.send_bytes(encoder.encode(EngineFailed(message)))
        sys.exit(1)
    startup.send_bytes(encoder.encode(EngineInfo(core.max_model_len, core.model_config.vocab_size,
                                                 core.runner.num_blocks, os.getpid(), lora_modules_of(core))))
    startup.close()
    trace_path = os.environ.get(TIMELINE_ENV)
    if trace_path:
        core.start_timeline()
    freeze_gc()
    try:
        loop.run()
    finally:
        if trace_path:
            write_timeline(core, trace_path, engine_index)
        shutdown = getattr(core, "shutdown", None)  # tensor-parallel workers go with their engine
        if shutdown is not None:
            shutdown()
