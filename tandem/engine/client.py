"""AsyncEngine: an API process's asyncio client of the engine-core process (ZeroMQ + msgspec)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tandem.engine.messages import (
    AbortClient,
    AbortRequest,
    AddRequest,
    ClientCommand,
    EngineBatch,
    UnloadLoRA,
    WireStats,
    merge_reported,
)
from tandem.engine.router import ReplicaRouter, SharedLoad, work
from tandem.lora_request import LoRARequest
from tandem.request import FinishReason
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PID_POLL_S = 0.25  # liveness poll of the engine process where pidfd_open is not available
DEFAULT_ENGINE_TIMEOUT_S = 10.0  # a replica silent this long is hung (it sends at least every HEARTBEAT_S)
DEFAULT_STEP_TIMEOUT_S = 120.0  # a replica whose loop has not gone round for this long is hung (see process.py)
LIVE, HUNG, DEAD = "live", "hung", "dead"  # a replica's state as this API process sees it


class QueueFullError(Exception):
    """The server already holds --max-queue waiting + running requests (HTTP 429)."""


class EngineUnavailableError(Exception):
    """The engine is shutting down or its process died (HTTP 503)."""


@dataclass(slots=True)
class Accepted:
    """The engine core added the request."""

    request_id: str


@dataclass(slots=True)
class Rejected:
    """The engine core refused the request: bad input (400) or its global queue is full (429)."""

    request_id: str
    message: str
    status: int = 400


@dataclass(slots=True)
class Failed:
    """This process ended the request without the engine: its replica died or hung, or the server shuts down."""

    request_id: str
    message: str
    status: int = 503


def is_terminal(item: Any) -> bool:
    """Whether a stream item is the last one its request will get."""
    return isinstance(item, (Rejected, Failed)) or bool(getattr(item, "finished", False))


class AsyncEngine:
    """One API process's view of the engine core(s).

    ``add`` / ``abort`` queue commands that go out in one message per engine per event-loop turn; a
    reader task takes each engine's one message per step and routes each request's items to the
    asyncio.Queue its caller registered. With data parallelism there is one engine-core process per
    replica: a ReplicaRouter picks each request's replica (prefix affinity, then load), and all of them
    send to this process's one output socket.

    Failure, per replica: every replica's pid is watched (pidfd), and so is the time it was last heard
    from (its heartbeat thread sends every second). A replica whose process died, that was silent for
    `engine_timeout` seconds (stopped, frozen), or whose heartbeat says its loop has not gone round for
    `step_timeout` seconds (a step deadlocked or stuck in a kernel) is taken out: its open requests end
    with a Failed item at once and new requests go to the others. A hung replica that speaks again
    rejoins (the aborts of its failed requests reach it first); a dead one stays out. Once no replica is
    live, `add` raises EngineUnavailableError and `is_alive` is False; once every replica is dead,
    `on_engine_death` is called.
    """

    def __init__(self, input_addrs: str | list[str], output_addr: str, *, client_index: int = 0, max_queue: int,
                 engine_pids: list[int] | None = None, on_engine_death: Callable[[str], None] | None = None,
                 block_size: int = 16, engine_timeout: float | None = DEFAULT_ENGINE_TIMEOUT_S,
                 step_timeout: float | None = DEFAULT_STEP_TIMEOUT_S, dead_replicas: list[int] | None = None,
                 shared_load: SharedLoad | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if engine_timeout is not None and not engine_timeout > 0:
            raise ValueError(f"engine_timeout must be > 0 seconds, got {engine_timeout}")
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {step_timeout}")
        self.input_addrs = [input_addrs] if isinstance(input_addrs, str) else list(input_addrs)
        self.output_addr = output_addr
        self.client_index = client_index
        self.max_queue = max_queue
        self.engine_pids = list(engine_pids or [])
        self.on_engine_death = on_engine_death
        self.router = ReplicaRouter(len(self.input_addrs), block_size, first=client_index,
                                    shared=shared_load.row(client_index) if shared_load is not None else None)
        self.engine_timeout = engine_timeout
        self.step_timeout = step_timeout if step_timeout is not None else float("inf")
        self.replica_state = [LIVE] * len(self.input_addrs)
        self.replica_error: list[str | None] = [None] * len(self.input_addrs)
        self.num_replica_failures = 0  # replicas taken out (deaths and hangs) since this process started
        self._fatal: str | None = None  # this process cannot reach any engine (its reader died)
        self._last_heard = [0.0] * len(self.input_addrs)
        for r in dead_replicas or []:
            self.replica_state[r] = DEAD
            self.replica_error[r] = f"engine replica {r} died before this API process started"
            self.router.set_up(r, False)
        self._replica_stats: list[WireStats | None] = [None] * len(self.input_addrs)
        self._streams: dict[str, asyncio.Queue] = {}  # accepted or pending, not yet terminal
        self._replica_of: dict[str, int] = {}  # same keys as _streams: the replica serving the request
        self._work_of: dict[str, int] = {}  # same keys: the work the router counted for it (router.work)
        self._outboxes: list[list[ClientCommand]] = [[] for _ in self.input_addrs]
        self._flush_scheduled = False
        self._stopping = False
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pushes: list[zmq.Socket] = []
        self._pull: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._pidfds: dict[int, int] = {}  # replica -> pidfd
        self._watchers: list[asyncio.Task] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineBatch)

    @property
    def stats(self) -> WireStats | None:
        """The engines' latest figures, merged over replicas (None until every replica has reported)."""
        return merge_reported(self._replica_stats)

    @property
    def num_requests(self) -> int:
        """Requests this process submitted that have not finished (waiting + running)."""
        return len(self._streams)

    @property
    def num_replicas(self) -> int:
        return len(self.input_addrs)

    @property
    def num_live_replicas(self) -> int:
        return self.replica_state.count(LIVE) if self._fatal is None else 0

    @property
    def error(self) -> str | None:
        """Why no replica can take requests (None while one can)."""
        if self._fatal is not None:
            return self._fatal
        if LIVE in self.replica_state:
            return None
        return "; ".join(e for e in self.replica_error if e) or None

    @property
    def is_alive(self) -> bool:
        return self._started and self.error is None and not self._stopping

    def start(self) -> None:
        """Connects to the engine core; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        for addr in self.input_addrs:
            push = zmq.Context.instance().socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(addr)
            self._pushes.append(push)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(self.output_addr)  # the engine core connects to it
        for replica, state in enumerate(self.replica_state):
            if state != DEAD:  # a process that replaces a dead one starts clean: its predecessor's requests go
                self._send(replica, AbortClient(self.client_index))
        self._reader = asyncio.ensure_future(self._read())
        now = time.monotonic()
        self._last_heard = [now] * self.num_replicas
        for replica, pid in enumerate(self.engine_pids):
            if self.replica_state[replica] != DEAD:
                self._watch_engine(replica, pid)
        if self.engine_timeout is not None:
            self._watchers.append(asyncio.ensure_future(self._watch_silence(self.engine_timeout)))
        self._started = True

    def add(self, requests: list[tuple[str, list[int], SamplingParams]], stream: asyncio.Queue,
            lora_request: LoRARequest | None = None) -> None:
        """Submits requests whose items (Accepted, then EngineOutputs / Rejected / Failed) go to stream, all with
        the LoRA adapter `lora_request` (None: the base model).

        All or none are submitted: raises QueueFullError if they do not fit under max_queue.
        """
        if not self.is_alive:
            raise EngineUnavailableError(self.error or "the engine is shutting down")
        if len(self._streams) + len(requests) > self.max_queue:
            raise QueueFullError(
                f"the server is at capacity ({len(self._streams)} of {self.max_queue} requests); retry later")
        for request_id, _, _ in requests:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
        for request_id, prompt_token_ids, params in requests:
            # Routed by the tokens in flight on each replica (the server has resolved max_tokens by now).
            replica = self.router.pick(prompt_token_ids, params.max_tokens)
            self._streams[request_id] = stream
            self._replica_of[request_id] = replica
            self._work_of[request_id] = work(prompt_token_ids, params.max_tokens)
            self._send(replica, AddRequest(request_id, prompt_token_ids, params, self.client_index, lora_request))

    def unload_lora(self, lora_int_id: int) -> None:
        """Tells every live replica to forget an adapter (its requests in flight finish with it)."""
        for replica, state in enumerate(self.replica_state):
            if state != DEAD:
                self._send(replica, UnloadLoRA(lora_int_id))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              stop_reason: str | None = None) -> None:
        """Stops a request (client gone, or a stop string matched); its stream gets nothing more."""
        if self._streams.pop(request_id, None) is None:
            return
        replica = self._release(request_id)
        if self.replica_state[replica] != DEAD:
            self._send(replica, AbortRequest(request_id, reason.value, stop_reason))

    async def shutdown(self) -> None:
        """Stops taking requests, fails the ones still open, closes the sockets (the engine goes on)."""
        self._stopping = True
        self._fail_all("the server is shutting down")
        if self._flush_scheduled:
            self._flush()
        if self._reader is not None:
            self._reader.cancel()
        for watcher in self._watchers:
            watcher.cancel()
        for replica in list(self._pidfds):
            self._unwatch(replica)
        for sock in (*self._pushes, self._pull):
            if sock is not None:
                sock.close(linger=500)
        if self._ctx is not None:
            self._ctx.term()

    # ---- sending -----------------------------------------------------------------------------

    def _send(self, replica: int, command: ClientCommand) -> None:
        self._outboxes[replica].append(command)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        for replica, commands in enumerate(self._outboxes):
            if commands and not self._pushes[replica].closed:
                self._pushes[replica].send(self._encoder.encode(commands), copy=False)
            self._outboxes[replica] = []

    # ---- receiving ---------------------------------------------------------------------------

    async def _read(self) -> None:
        assert self._pull is not None
        try:
            while True:
                frame = await self._pull.recv(copy=False)
                self._dispatch(self._decoder.decode(frame.buffer))
                # recv() does not yield while messages are queued: give the streams this batch fed
                # their turn before the next one, or a backlog would starve every other task.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bad message is a bug in this process: fail loudly, not silently hang
            logger.exception("the engine output reader died")
            self._engine_gone("the engine output reader died in this API process")

    def _dispatch(self, batch: EngineBatch) -> None:
        replica = batch.engine_index
        self._last_heard[replica] = time.monotonic()
        if batch.stalled_s > self.step_timeout:
            if self.replica_state[replica] == LIVE:
                self._replica_hung(replica, f"{self._who(replica)} has not finished a step for "
                                            f"{batch.stalled_s:.0f} s (--engine-step-timeout {self.step_timeout:g} s): "
                                            "it is deadlocked or stuck in a kernel")
        elif self.replica_state[replica] == HUNG:
            self._replica_back(replica)
        if batch.stats is not None:
            self._replica_stats[replica] = batch.stats
        streams = self._streams
        for request_id in batch.accepted:
            stream = streams.get(request_id)
            if stream is not None:
                stream.put_nowait(Accepted(request_id))
        for rejection in batch.rejected:
            stream = streams.pop(rejection.request_id, None)
            if stream is not None:
                self._release(rejection.request_id)
                stream.put_nowait(Rejected(rejection.request_id, rejection.message, rejection.status))
        for output in batch.outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue  # aborted here meanwhile; the item is stale
            if output.finished:
                del streams[output.request_id]
                self._release(output.request_id)
            stream.put_nowait(output)

    # ---- engine liveness ---------------------------------------------------------------------

    def _watch_engine(self, replica: int, pid: int) -> None:
        assert self._loop is not None
        message = self._who(replica, pid) + " died"
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd here: poll instead
            self._watchers.append(asyncio.ensure_future(self._poll_pid(replica, pid, message)))
            return
        self._pidfds[replica] = pidfd
        self._loop.add_reader(pidfd, self._replica_died, replica, message)

    def _unwatch(self, replica: int) -> None:
        pidfd = self._pidfds.pop(replica, None)
        if pidfd is not None:
            if self._loop is not None:
                self._loop.remove_reader(pidfd)
            os.close(pidfd)

    def _who(self, replica: int, pid: int | None = None) -> str:
        if pid is None and replica < len(self.engine_pids):
            pid = self.engine_pids[replica]
        what = "the engine core process" if self.num_replicas == 1 else f"engine replica {replica}"
        return f"{what} (pid {pid})" if pid is not None else what

    async def _poll_pid(self, replica: int, pid: int, message: str) -> None:
        while _pid_alive(pid):
            await asyncio.sleep(PID_POLL_S)
        self._replica_died(replica, message)

    async def _watch_silence(self, timeout: float) -> None:
        """Takes out a replica this process has not heard from for `timeout` seconds (checked every `tick`, so
        that it is out by then, not a tick later)."""
        assert self._pull is not None
        tick = min(0.25, timeout / 4)
        while True:
            await asyncio.sleep(tick)
            if self._pull.closed:
                return
            # Unread messages mean this process is behind, not that a replica is silent: each may be in
            # there. Then a replica counts as silent only against the newest news of the others, which
            # the reader's progress keeps fresh while a hung replica's stays old.
            behind = bool(self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN)
            now = time.monotonic()
            newest = max((t for t, s in zip(self._last_heard, self.replica_state) if s != DEAD), default=now)
            for replica, state in enumerate(self.replica_state):
                silent = now - self._last_heard[replica]
                if behind and newest - self._last_heard[replica] <= timeout:
                    continue
                if state == LIVE and silent + tick > timeout:
                    self._replica_hung(replica, f"{self._who(replica)} sent nothing for {silent:.1f} s "
                                                f"(--engine-timeout {timeout:g} s): its process is stopped or "
                                                "frozen")

    def _replica_died(self, replica: int, message: str) -> None:
        if self.replica_state[replica] == DEAD:
            return
        self._unwatch(replica)
        was_live = self.replica_state[replica] == LIVE
        self.replica_state[replica] = DEAD
        self.replica_error[replica] = message
        self.router.set_up(replica, False)
        if was_live:
            self.num_replica_failures += 1
        self._fail_replica(replica, message)
        if all(state == DEAD for state in self.replica_state) and self.on_engine_death is not None \
                and not self._stopping:
            self.on_engine_death(message)

    def _replica_hung(self, replica: int, message: str) -> None:
        self.replica_state[replica] = HUNG
        self.replica_error[replica] = message
        self.router.set_up(replica, False)
        self.num_replica_failures += 1
        # Its requests end here now; the aborts wait in the socket and free their KV blocks if it resumes.
        for request_id in self._fail_replica(replica, message):
            self._send(replica, AbortRequest(request_id, FinishReason.ABORT.value))

    def _replica_back(self, replica: int) -> None:
        logger.warning("%s is heard from again: it takes requests again", self._who(replica))
        self.replica_state[replica] = LIVE
        self.replica_error[replica] = None
        self.router.set_up(replica, True)

    def _release(self, request_id: str) -> int:
        """Forgets an open request's replica and gives its work back to the router; returns the replica."""
        replica = self._replica_of.pop(request_id)
        self.router.release(replica, self._work_of.pop(request_id))
        return replica

    def _fail_replica(self, replica: int, message: str) -> list[str]:
        """Ends every open request of one replica with Failed(message); returns their ids."""
        ids = [rid for rid, r in self._replica_of.items() if r == replica]
        logger.error("%s: failing %d open requests", message, len(ids))
        for request_id in ids:
            self._release(request_id)
            self._streams.pop(request_id).put_nowait(Failed(request_id, message))
        return ids

    def _engine_gone(self, message: str) -> None:
        """This process cannot go on with any replica (its output reader died): fail everything."""
        if self._fatal is not None:
            return
        for replica in list(self._pidfds):
            self._unwatch(replica)
        logger.error("%s: failing %d open requests", message, len(self._streams))
        self._fatal = message
        self._fail_all(message)
        if self.on_engine_death is not None and not self._stopping:
            self.on_engine_death(message)

    def _fail_all(self, message: str) -> None:
        streams, self._streams = self._streams, {}
        for request_id in list(self._replica_of):
            self._release(request_id)
        for request_id, stream in streams.items():
            stream.put_nowait(Failed(request_id, message))


def _pid_alive(pid: int) -> bool:
    """Whether pid runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
