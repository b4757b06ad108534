"""Bounded work before admission and the security defaults, on the real HTTP stack (uvicorn + the app) in front of
a stand-in engine: body size (413), header and body timeouts, the connection cap (503 + Retry-After), the
prompt-length precheck and the tokenization time limit, the API key on every route, CORS off, scrubbed errors."""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest

from tandem.server.limits import HttpLimits, bounded_uvicorn_config
from tandem.server.security import ApiKeyMiddleware, public_message
from tests.server.conftest import free_port

API_KEY = "limits-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
LIMITS = HttpLimits(max_request_bytes=2**20, max_connections=80, header_timeout_s=1.0, body_timeout_s=1.0,
                    keep_alive_s=5.0)


class StandInEngine:
    """What the app needs of an AsyncEngine to refuse requests; nothing may reach add()."""

    max_queue = 64
    is_alive = True
    error = None
    stats = None
    num_requests = 0
    num_replicas = num_live_replicas = 1
    num_replica_failures = 0
    replica_state = ["live"]
    replica_error: list[str | None] = [None]

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def add(self, *args: Any) -> None:
        raise AssertionError("a refused request reached the engine")


@pytest.fixture(scope="module")
def tokenizer():
    from tandem.config import EngineConfig
    from tandem.models.loader import load_tokenizer

    return load_tokenizer(EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=16))


def _serve(app: Any, limits: HttpLimits) -> tuple[Any, threading.Thread, int]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(bounded_uvicorn_config(app, limits, app.state.metrics.count_rejected, host="127.0.0.1",
                                                   port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    return server, thread, port


@pytest.fixture(scope="module")
def server(tokenizer):
    from tandem.server.app import build_app

    app = build_app(StandInEngine(), tokenizer, model_names=["m"], max_model_len=MAX_MODEL_LEN, vocab_size=49152,
                    api_key=API_KEY)
    uv, thread, port = _serve(app, LIMITS)
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, app=app)
    uv.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def _head(path: str, length: int | None = None, chunked: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Authorization: Bearer {API_KEY}", "Content-Type: application/json"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _healthy(server) -> None:
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).status_code == 200


# ---- bounded work before admission ---------------------------------------------------------------------------


def test_declared_body_over_the_limit_is_refused_before_it_is_read(server):
    with _connect(server.port) as sock:
        start = time.perf_counter()
        sock.sendall(_head("/v1/completions", 50 * 2**20) + b'{"prompt": "' + b"a" * 65536)
        status, headers, body = _read_response(sock)
        elapsed = time.perf_counter() - start
        assert status == 413 and headers["connection"] == "close", (status, headers)
        error = orjson.loads(body)["error"]
        assert error["code"] == "request_too_large" and str(2**20) in error["message"]
        assert elapsed < 1.0, elapsed  # typically a millisecond: nothing of the 50 MB is read
        assert _closed_by_server(sock, 5)
    _healthy(server)


def test_chunked_body_is_counted_as_it_arrives(server):
    with _connect(server.port) as sock:
        sock.sendall(_head("/v1/completions", chunked=True))
        chunk = b"a" * 65536
        status = None
        for _ in range(64):  # 4 MiB at most; the server answers once past 1 MiB
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                break
        status, headers, body = _read_response(sock)
        assert status == 413 and headers["connection"] == "close"
        assert orjson.loads(body)["error"]["code"] == "request_too_large"
    _healthy(server)


def test_slow_body_gets_408(server):
    with _connect(server.port) as sock:
        sock.sendall(_head("/v1/completions", 100) + b'{"prompt": ')
        status, headers, body = _read_response(sock)  # after body_timeout_s (1 s here)
        assert status == 408 and orjson.loads(body)["error"]["code"] == "request_timeout"
    _healthy(server)


def test_idle_and_slow_header_connections_are_closed(server):
    idle, slow = _connect(server.port), _connect(server.port)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    time.sleep(0.5)
    slow.sendall(b"X-Slow: 1\r\n")  # still sending, but the headers' deadline counts from their start
    assert _closed_by_server(idle, 3) and _closed_by_server(slow, 3)
    idle.close()
    slow.close()


def test_oversized_headers_get_431(server):
    with _connect(server.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        status, _, _ = _read_response(sock)
        assert status == 431


def test_connections_beyond_the_cap_get_503_with_retry_after(server):
    idle = [_connect(server.port) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.2)
        r = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "too_many_connections"
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    _healthy(server)


def test_idle_and_slow_connections_do_not_slow_a_normal_request(server):
    def latencies(n: int = 20) -> list[float]:
        out = []
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=10) as client:
            for _ in range(n):
                start = time.perf_counter()
                assert client.get("/v1/models").status_code == 200
                out.append(time.perf_counter() - start)
        return out

    base = statistics.median(latencies())
    socks = [_connect(server.port) for _ in range(50)]
    for i, sock in enumerate(socks[::2]):  # half idle, half trickling a request line
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nX-{i}: ".encode())
    loaded = statistics.median(latencies())
    for sock in socks:
        sock.close()
    assert loaded < 2 * base + 0.005, (base, loaded)


def test_prompt_that_cannot_fit_is_refused_without_tokenizing(server):
    serving = server.app.state.serving
    calls = []
    encode = serving.tokenizer.encode
    serving.tokenizer.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    try:
        limit = serving.encoder.max_chars()
        assert limit is not None and limit >= MAX_MODEL_LEN
        for body in ({"prompt": "a" * (limit + 1)}, {"prompt": ["hi", "a" * (limit + 1)]},
                     {"messages": [{"role": "user", "content": "a" * (limit + 1)}]}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=10)
            assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
        assert not calls
    finally:
        serving.tokenizer.encode = encode


class _SlowTokenizer:
    """A tokenizer whose encode takes at least `seconds` (the time limit's test cannot then lose the race to a
    tokenization that finishes first on a busy machine)."""

    def __init__(self, tokenizer: Any, seconds: float) -> None:
        self._tokenizer, self._seconds = tokenizer, seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self._seconds)
        return self._tokenizer.encode(*args, **kwargs)


def test_tokenization_time_limit(server):
    encoder = server.app.state.serving.encoder
    saved = encoder.timeout_s, encoder.inline_chars, encoder.tokenizer
    encoder.timeout_s, encoder.inline_chars = 0.05, 0
    encoder.tokenizer = _SlowTokenizer(encoder.tokenizer, 1.0)
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello " * 2000}, headers=AUTH, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "tokenization_timeout", r.text
    finally:
        encoder.timeout_s, encoder.inline_chars, encoder.tokenizer = saved
    _healthy(server)


def test_tokenization_runs_off_the_event_loop(tokenizer):
    from tandem.server.prompts import PromptEncoder

    encoder = PromptEncoder(tokenizer, max_model_len=10**6)
    text = "hello world " * 100_000  # about 0.1 - 1 s of encoding

    async def main() -> int:
        ticks = 0
        job = asyncio.ensure_future(encoder.encode(text, "prompt"))
        while not job.done():
            await asyncio.sleep(0.001)
            ticks += 1
        assert len(job.result()) > 100_000
        return ticks

    assert asyncio.run(main()) > 20  # the loop kept turning while the text was tokenized
    encoder.close()


# ---- security defaults -----------------------------------------------------------------------------------------


def test_key_needed_on_every_route_but_health(server):
    for method, path in (("GET", "/"), ("GET", "/static/playground.js"), ("GET", "/metrics"), ("GET", "/docs"),
                         ("GET", "/openapi.json"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/no/such/route")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = httpx.request(method, f"{server.url}{path}", headers=headers, timeout=10)
            assert r.status_code == 401, (method, path, r.status_code)
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    for path in ("/", "/metrics", "/v1/models", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}", headers=AUTH, timeout=10).status_code == 200, path
        basic = httpx.get(f"{server.url}{path}", auth=httpx.BasicAuth("anyone", API_KEY), timeout=10)
        assert basic.status_code == 200, path


def test_key_check_is_constant_time_over_digests(monkeypatch):
    import hmac

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((len(a), len(b))) or real(a, b))
    mw = ApiKeyMiddleware(None, "k" * 40)
    for value in (b"Bearer x", b"Bearer " + b"k" * 40, b"Basic !!", b"Token abc", b""):
        mw.authorized({"headers": [(b"authorization", value)]})
    assert compared == [(32, 32)] * 5  # every comparison is of two SHA-256 digests, whatever was sent


def test_no_cors_headers_unless_asked(server):
    origin = {"Origin": "https://evil.example"}
    pre = httpx.options(f"{server.url}/v1/completions", timeout=10,
                        headers={**origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers
    r = httpx.get(f"{server.url}/v1/models", headers={**AUTH, **origin}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_for_named_origins_only(tokenizer):
    from starlette.testclient import TestClient

    from tandem.server.app import build_app

    app = build_app(StandInEngine(), None, model_names=["m"], max_model_len=MAX_MODEL_LEN, vocab_size=10,
                    api_key=API_KEY, allowed_origins=["https://ok.example"])
    client = TestClient(app)
    pre = client.options("/v1/completions", headers={"Origin": "https://ok.example",
                                                     "Access-Control-Request-Method": "POST",
                                                     "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ok.example"
    bad = client.options("/v1/completions", headers={"Origin": "https://evil.example",
                                                     "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in bad.headers
    assert client.get("/v1/models", headers={"Origin": "https://ok.example"}).status_code == 401


def test_error_bodies_carry_no_trace_or_path(server, monkeypatch):
    serving = server.app.state.serving

    def broken() -> None:
        raise RuntimeError(f"boom in {__file__} line 3")

    monkeypatch.setattr(serving, "models", broken)
    r = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 500 and r.json()["error"] == {"message": "internal server error", "type": "server_error",
                                                          "param": None, "code": 500}
    for text in ("engine core died: FileNotFoundError(2, 'x', '/opt/tandem/lib/python3.11/a.py')",
                 "step failed\nTraceback (most recent call last):\n  File \"/x/y.py\", line 1\nValueError"):
        scrubbed = public_message(text)
        assert ".py" not in scrubbed and "Traceback" not in scrubbed and "/opt" not in scrubbed, scrubbed
    bad = [httpx.post(f"{server.url}/v1/completions", content=body, headers=AUTH, timeout=10)
           for body in (b"{", b'{"prompt": 1}', b"[" * 100_000, b'{"prompt": "x", "n": "2"}')]
    for r in bad:
        assert r.status_code == 400
        assert "Traceback" not in r.text and ".py" not in r.text and "/tandem/" not in r.text, r.text
