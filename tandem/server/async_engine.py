"""AsyncEngine: runs an EngineCore's step loop in its own thread and streams its outputs to asyncio."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from tandem.request import FinishReason
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05  # how stale the /metrics snapshot of EngineStats may be while busy


class QueueFullError(Exception):
    """The server already holds --max-queue waiting + running requests (HTTP 429)."""


class EngineUnavailableError(Exception):
    """The engine is shutting down or its thread died (HTTP 503)."""


@dataclass(slots=True)
class Accepted:
    """The engine thread added the request to the core."""

    request_id: str


@dataclass(slots=True)
class Rejected:
    """EngineCore.add_request raised ValueError: the client's input was bad (HTTP 400)."""

    request_id: str
    message: str


@dataclass(slots=True)
class Failed:
    """The engine failed the request (a step raised, or shutdown): HTTP 500 or an SSE error event."""

    request_id: str
    message: str


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Abort:
    request_id: str
    reason: FinishReason
    stop_reason: str | None


class _Stop:
    pass


def is_terminal(item: Any) -> bool:
    """Whether a stream item is the last one its request will get."""
    return isinstance(item, (Rejected, Failed)) or bool(getattr(item, "finished", False))


class AsyncEngine:
    """Thread-safe front of one EngineCore.

    Loop side (the HTTP event loop): ``add`` / ``abort`` put commands on a thread-safe queue and
    register the caller's asyncio.Queue per request id. Engine thread: applies commands between
    steps, runs ``step()`` while there is work, and hands each iteration's items back to the loop
    with one ``call_soon_threadsafe``. The tokenizer is never touched on the engine thread.
    """

    def __init__(self, core: Any, max_queue: int) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.core = core
        self.max_queue = max_queue
        self.stats: Any = None  # latest EngineStats snapshot, replaced (never mutated) by the engine thread
        self.error: str | None = None  # set if the engine thread died
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}  # loop side only: accepted, not yet terminal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._live: set[str] = set()  # engine thread only: ids added to the core and not finished
        self._last_stats_time = 0.0

    # ---- loop side -------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished (waiting + running, as the server counts them)."""
        return len(self._streams)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._snapshot_stats()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    def add(self, requests: list[tuple[str, list[int], SamplingParams]], stream: asyncio.Queue) -> None:
        """Submits requests whose items (Accepted, then EngineOutputs / Rejected / Failed) go to stream.

        All or none are accepted: raises QueueFullError if they do not fit under max_queue.
        """
        if self._stopping or not self.is_alive:
            raise EngineUnavailableError(self.error or "the engine is shutting down")
        if len(self._streams) + len(requests) > self.max_queue:
            raise QueueFullError(
                f"the server is at capacity ({len(self._streams)} of {self.max_queue} requests); retry later")
        for request_id, _, _ in requests:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
        for request_id, prompt_token_ids, params in requests:
            self._streams[request_id] = stream
            self._commands.put(_Add(request_id, prompt_token_ids, params))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              stop_reason: str | None = None) -> None:
        """Stops a request (client gone, or a stop string matched); its stream gets nothing more."""
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(_Abort(request_id, reason, stop_reason))

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Rejects new requests, fails whatever the engine still holds, joins the thread."""
        self._stopping = True
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, timeout_s)

    def _dispatch(self, items: list[Any]) -> None:
        for item in items:
            stream = self._streams.get(item.request_id)
            if stream is None:
                continue  # aborted by the loop side; the item is stale
            if is_terminal(item):
                del self._streams[item.request_id]
            stream.put_nowait(item)

    # ---- engine thread ---------------------------------------------------------------------

    def _deliver(self, items: list[Any]) -> None:
        if not items:
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._dispatch, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            logger.warning("dropping %d engine items: event loop closed", len(items))

    def _run(self) -> None:
        try:
            while True:
                busy = self.core.has_unfinished_requests()
                if self._apply(self._drain(block=not busy)):
                    break
                if self.core.has_unfinished_requests():
                    self._step()
                now = time.monotonic()
                if not self.core.has_unfinished_requests() or now - self._last_stats_time >= STATS_INTERVAL_S:
                    self._snapshot_stats()
            self._fail_live("the server is shutting down")
        except BaseException as exc:  # a bug outside step(): fail everyone rather than hang them
            logger.exception("engine thread died")
            self.error = f"engine thread died: {exc!r}"
            self._fail_live(self.error)
        finally:
            self._snapshot_stats()

    def _drain(self, block: bool) -> list[_Add | _Abort | _Stop]:
        commands = []
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[_Add | _Abort | _Stop]) -> bool:
        """Applies add/abort commands in order; returns True on stop."""
        items: list[Any] = []
        stop = False
        for command in commands:
            if isinstance(command, _Stop):
                stop = True
            elif isinstance(command, _Add):
                items.append(self._add(command))
            elif command.request_id in self._live:
                self._live.discard(command.request_id)
                try:
                    self.core.abort_request(command.request_id, command.reason, command.stop_reason)
                except Exception:
                    logger.exception("abort_request(%s) failed", command.request_id)
        self._deliver(items)
        return stop

    def _add(self, command: _Add) -> Accepted | Rejected | Failed:
        try:
            self.core.add_request(command.request_id, command.prompt_token_ids, command.params)
        except ValueError as exc:
            return Rejected(command.request_id, str(exc))
        except Exception as exc:
            logger.exception("add_request(%s) failed", command.request_id)
            return Failed(command.request_id, f"the engine could not add the request: {exc!r}")
        self._live.add(command.request_id)
        return Accepted(command.request_id)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:
            # The core could not say which requests the step held, so all it holds are failed and
            # aborted: the core comes back empty and consistent, and the loop goes on serving.
            logger.exception("engine step failed")
            self._fail_live(f"engine step failed: {exc!r}")
            return
        for output in outputs:
            if output.finished:
                self._live.discard(output.request_id)
        self._deliver(outputs)

    def _fail_live(self, message: str) -> None:
        failed = sorted(self._live)
        self._live.clear()
        for request_id in failed:
            try:
                self.core.abort_request(request_id, FinishReason.ABORT)
            except Exception:
                logger.exception("abort_request(%s) failed while failing it", request_id)
        self._deliver([Failed(request_id, message) for request_id in failed])

    def _snapshot_stats(self) -> None:
        try:
            self.stats = self.core.stats()
        except Exception:
            logger.exception("EngineCore.stats() failed")
        self._last_stats_time = time.monotonic()
