"""Security defaults of the HTTP app: the API key on every route but /health, CORS only when asked, scrubbed errors."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Callable
from typing import Any

from tandem.server.limits import send_error

OPEN_PATHS = frozenset({"/health"})  # what a load balancer probes without credentials
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@+~-]+){2,}")
MAX_ERROR_CHARS = 500


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiKeyMiddleware:
    """ASGI middleware: `Authorization: Bearer KEY` (or HTTP Basic with KEY as the password, which a browser
    asks for itself when it opens the playground) on every path but /health (and /metrics with public_metrics).

    The key is compared in constant time over SHA-256 digests, so neither its content nor its length shows in
    the time of a refusal. CORS preflights (OPTIONS with Access-Control-Request-Method) pass when CORS is on.
    """

    def __init__(self, app: Callable, api_key: str, *, public_metrics: bool = False, cors: bool = False,
                 on_reject: Callable[[int], None] | None = None) -> None:
        self.app = app
        self._key_digest = _digest(api_key.encode())
        self.open_paths = OPEN_PATHS | ({"/metrics"} if public_metrics else set())
        self.cors = cors
        self.on_reject = on_reject

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._is_preflight(scope) \
                or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject(401)
        # Basic lets a browser prompt for the key on the playground page (any user name, the key as password).
        # One challenge per header, Basic first: browsers do not take Basic out of a combined "Bearer, Basic ...".
        await send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                         type="authentication_error", code="invalid_api_key",
                         headers=[(b"www-authenticate", b'Basic realm="tandem"'), (b"www-authenticate", b"Bearer")])

    def authorized(self, scope: dict) -> bool:
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        scheme, _, credential = given.partition(b" ")
        scheme = scheme.lower()
        if scheme == b"basic":
            try:
                credential = base64.b64decode(credential.strip(), validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                credential = b""
        elif scheme != b"bearer":
            credential = b""
        return hmac.compare_digest(_digest(credential.strip()), self._key_digest)

    def _is_preflight(self, scope: dict) -> bool:
        if not self.cors or scope["method"] != "OPTIONS":
            return False
        return any(name == b"access-control-request-method" for name, _ in scope.get("headers", ()))


def add_security_args(group: Any) -> None:
    """`tandem serve` flags for the app's exposure."""
    group.add_argument("--public-metrics", action="store_true",
                       help="serve /metrics without the API key (e.g. to a scraper on a trusted network)")
    group.add_argument("--allowed-origin", action="append", default=None, metavar="ORIGIN",
                       help="let browser pages from ORIGIN call the API (CORS; repeatable; '*' for any). "
                            "Default: no CORS headers, so other sites' pages cannot read responses")


def cors_middleware_kwargs(origins: list[str]) -> dict[str, Any]:
    """Starlette CORSMiddleware arguments for the given origins (credentials only for named origins)."""
    return {"allow_origins": origins, "allow_methods": ["GET", "POST", "OPTIONS"],
            "allow_headers": ["Authorization", "Content-Type"], "allow_credentials": "*" not in origins,
            "max_age": 600}


def public_message(message: str) -> str:
    """A server-side error message fit for a response body: no traceback, no file path, bounded length."""
    message = message.split("Traceback (most recent call last)", 1)[0].strip() or "internal server error"
    message = _PATH.sub("<path>", message)
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."
