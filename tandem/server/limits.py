"""What one connection or request may cost an API process before admission: body size, read timeouts, connections.

Two layers, both in front of the app:
- the HTTP protocol (a subclass of uvicorn's httptools protocol) closes a connection whose request line and
  headers do not arrive within `header_timeout_s` or exceed `max_header_bytes`, and answers 503 with
  Retry-After on every connection beyond `max_connections` open in this process;
- an ASGI middleware answers 413 at once to a Content-Length above `max_request_bytes` (before reading a
  byte of the body), counts the bytes of a chunked body as they arrive (413 once past the limit), and answers
  408 to a body that does not arrive within `body_timeout_s`. These responses close the connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from tandem.server.protocol import ApiError, error_body

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
DEFAULT_MAX_CONNECTIONS = 2048
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_S = 5.0
MAX_HEADER_BYTES = 64 * 2**10
RETRY_AFTER_S = 1

OnReject = Callable[[int], None]  # called with the status of every refusal made here (for /metrics)


@dataclass(frozen=True)
class HttpLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    max_header_bytes: int = MAX_HEADER_BYTES

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_connections", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.removesuffix('_s').replace('_', '-')} must be > 0, got {getattr(self, name)}")


def bounded_uvicorn_config(app: Callable, limits: HttpLimits, on_reject: OnReject | None = None,
                           **kwargs: Any) -> Any:
    """A uvicorn.Config serving `app` behind `limits` (the body middleware and the bounded HTTP protocol)."""
    import uvicorn

    raise_open_files_limit()
    return uvicorn.Config(BodyLimitMiddleware(app, limits, on_reject), **uvicorn_kwargs(limits, on_reject), **kwargs)


def uvicorn_kwargs(limits: HttpLimits, on_reject: OnReject | None = None) -> dict[str, Any]:
    """uvicorn.Config arguments that put `limits` on the HTTP protocol (the app is wrapped separately)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn's h11 protocol, without the header timeout and connection cap
        logger.warning("httptools is not installed: no header timeout and no connection cap")
        return {"timeout_keep_alive": limits.keep_alive_s, "h11_max_incomplete_event_size": limits.max_header_bytes}
    return {"http": bounded_protocol(HttpToolsProtocol, limits, on_reject), "timeout_keep_alive": limits.keep_alive_s}


def bounded_protocol(base: type, limits: HttpLimits, on_reject: OnReject | None = None) -> type:
    """`base` (uvicorn's HttpToolsProtocol) with a header deadline, a header size cap and a connection cap."""

    class BoundedHttpProtocol(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0
        _refused = False  # answered 431 and closing: the parser's remaining callbacks are ignored

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self.app = _over_capacity_app(limits.max_connections, on_reject)  # this connection's app only
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0
            if self._header_timer is None:
                self._arm_header_timer()

        def on_url(self, url: bytes) -> None:
            if self._count_header_bytes(len(url)):
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._count_header_bytes(len(name) + len(value) + 4):
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            if not self._refused:
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                super().on_message_complete()

        def _count_header_bytes(self, num: int) -> bool:
            """Whether the request line and headers are still within the limit (else: 431, closing)."""
            self._header_bytes += num
            if self._refused:
                return False
            if self._header_bytes > limits.max_header_bytes:
                self._refused = True
                if on_reject is not None:
                    on_reject(431)
                self._cancel_header_timer()
                self.transport.write(_raw_error(431, "Request Header Fields Too Large",
                                                f"the request line and headers exceed {limits.max_header_bytes} bytes"))
                self.transport.close()
                return False
            return True

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            # A client that opened a connection (or began a request) and did not finish its headers in time:
            # it holds a descriptor and a slot, so it goes without an answer (as nginx's client_header_timeout).
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return BoundedHttpProtocol


def _raw_error(status: int, reason: str, message: str, extra_headers: str = "") -> bytes:
    body = orjson.dumps(error_body(message, type="invalid_request_error", code=status))
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra_headers}connection: close\r\n\r\n").encode() + body


def _over_capacity_app(max_connections: int, on_reject: OnReject | None) -> Callable:
    async def over_capacity(scope: dict, receive: Callable, send: Callable) -> None:
        if on_reject is not None:
            on_reject(503)
        await send_error(send, 503, f"the server holds {max_connections} connections, its limit; retry later",
                         type="server_error", code="too_many_connections",
                         headers=[(b"retry-after", str(RETRY_AFTER_S).encode())])

    return over_capacity


async def send_error(send: Callable, status: int, message: str, *, type: str = "invalid_request_error",
                     code: int | str | None = None, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An OpenAI error response sent straight on the ASGI channel, closing the connection after it."""
    body = orjson.dumps(error_body(message, type=type, code=code if code is not None else status))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyLimitMiddleware:
    """ASGI middleware: request bodies of at most `max_request_bytes`, arriving within `body_timeout_s`."""

    def __init__(self, app: Callable, limits: HttpLimits, on_reject: OnReject | None = None) -> None:
        self.app = app
        self.limits = limits
        self.on_reject = on_reject

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_request_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            if self.on_reject is not None:
                self.on_reject(413)
            await send_error(send, 413, f"the request body is {length} bytes; this server takes at most {limit} "
                                        "(--max-request-bytes)", code="request_too_large")
            return
        state = _BodyState(asyncio.get_running_loop().time() + self.limits.body_timeout_s)

        async def bounded_receive() -> dict:
            if state.done:  # the body is in: later receives wait for the disconnect, without a deadline
                return await receive()
            try:
                async with asyncio.timeout_at(state.deadline):
                    message = await receive()
            except TimeoutError:
                state.close = True
                raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                               code="request_timeout") from None
            if message["type"] == "http.request":
                state.received += len(message.get("body", b""))
                if state.received > limit:
                    state.close = True
                    raise ApiError(413, f"the request body exceeds {limit} bytes (--max-request-bytes)",
                                   code="request_too_large")
                state.done = not message.get("more_body", False)
            else:
                state.done = True
            return message

        async def closing_send(message: dict) -> None:
            if state.close and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, bounded_receive, closing_send)


@dataclass(slots=True)
class _BodyState:
    deadline: float
    received: int = 0
    done: bool = False
    close: bool = False  # the refused body was not read to its end: the connection cannot be reused


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses a malformed length before the app runs
    return None


def raise_open_files_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: each connection holds a descriptor, and the common soft
    default (1024) would stop accepts well before --max-connections."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError) as exc:
        logger.warning("could not raise the open-files limit: %s", exc)


def add_limit_args(group: Any) -> None:
    """`tandem serve` flags for HttpLimits."""
    group.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="largest request body; a larger one gets 413 before it is read")
    group.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       help="open connections per API process; requests on more get 503 with Retry-After")
    group.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                       help="seconds a connection may take to send a request's line and headers before it is closed")
    group.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                       help="seconds a request's body may take to arrive (408 after)")
    group.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_S,
                       help="seconds an idle kept-alive connection stays open")


def limits_from_args(args: Any) -> HttpLimits:
    return HttpLimits(max_request_bytes=args.max_request_bytes, max_connections=args.max_connections,
                      header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                      keep_alive_s=args.keep_alive_timeout)
