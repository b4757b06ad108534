"""Hostile clients against `tandem serve` (the embedded model on CPU): how fast big bodies are refused, and what
1,000 idle or slowly-sending connections do to a normal request's latency.

    PYTHONPATH=. python scripts/bench_hostile_clients.py --out benchmarks/results/cpu/hostile_clients.json

Measured, each as the median of --repeats tries:
- a 50 MB body with Content-Length (refused by --max-request-bytes before it is read): send start to the 413;
- a 50 MB body sent chunked (counted as it arrives): send start to the 413;
- a 10 MB prompt string inside the body limit (refused by the length precheck, never tokenized): to the 400;
- a 50 MB prompt string with the body limit raised to 64 MiB (second server): JSON parse + precheck, to the 400;
- a normal request (GET /v1/models, and a 1-token completion) on an idle server, then with 1,000 connections
  open, half idle and half trickling a header byte every second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

KEY = "hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(extra: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", "--port", str(port), "--device", "cpu",
                             "--max-model-len", "2048", "--num-kv-blocks", "256", "--api-key", KEY,
                             "--log-level", "warning", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.5)


def read_status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed: {data!r}")
        data += chunk
    return int(data.split()[1])


def timed_refusal(port: int, head: bytes, body_chunks, expect: int) -> float:
    """Seconds from the first byte sent to the status line, while a thread keeps sending the body."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    stop = threading.Event()

    def sender() -> None:
        try:
            for chunk in body_chunks:
                if stop.is_set():
                    return
                sock.sendall(chunk)
        except OSError:
            pass

    start = time.perf_counter()
    sock.sendall(head)
    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    status = read_status(sock)
    elapsed = time.perf_counter() - start
    stop.set()
    sock.close()
    thread.join(5)
    assert status == expect, status
    return elapsed


def head(length: int | None, path: str = "/v1/completions") -> bytes:
    te = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{te}\r\n\r\n").encode()


def prompt_body(num_bytes: int) -> bytes:
    return b'{"prompt": "' + b"hello world " * (num_bytes // 12) + b'", "max_tokens": 1}'


def slices(data: bytes, size: int = 2**20):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def chunked(data: bytes, size: int = 2**16):
    for i in range(0, len(data), size):
        part = data[i:i + size]
        yield b"%x\r\n%s\r\n" % (len(part), part)
    yield b"0\r\n\r\n"


def latency(port: int, repeats: int, completions: int) -> dict[str, float]:
    """Median seconds of GET /v1/models (the HTTP path alone) and of a 1-token completion, each on a new connection."""
    out: dict[str, list[float]] = {"models": [], "completion_1_token": []}
    for i in range(repeats):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=120) as client:
            t = time.perf_counter()
            assert client.get("/v1/models").status_code == 200
            out["models"].append(time.perf_counter() - t)
            if i < completions:
                t = time.perf_counter()
                r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
                assert r.status_code == 200, r.text
                out["completion_1_token"].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in out.items() if v}


def hostile_connections(port: int, num: int) -> tuple[list[socket.socket], threading.Event]:
    socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(num)]
    stop = threading.Event()

    def trickle() -> None:  # half the connections send a header byte per second, as slowloris does
        for i, s in enumerate(socks[::2]):
            try:
                s.sendall(f"POST /v1/completions HTTP/1.1\r\nX-{i}: ".encode())
            except OSError:
                pass
        while not stop.wait(1.0):
            for s in socks[::2]:
                try:
                    s.sendall(b"a")
                except OSError:
                    pass

    threading.Thread(target=trickle, daemon=True).start()
    return socks, stop


def _open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--completions", type=int, default=10, help="1-token completions timed per phase")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result: dict[str, object] = {
        "benchmark": "hostile_clients", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start)",
        "command": "python " + " ".join(sys.argv),
    }
    proc, port = start([])
    try:
        big = prompt_body(50 * 10**6)
        result["refuse_50MB_content_length_s"] = statistics.median(
            timed_refusal(port, head(len(big)), slices(big), 413) for _ in range(args.repeats))
        result["refuse_50MB_chunked_s"] = statistics.median(
            timed_refusal(port, head(None), chunked(big), 413) for _ in range(max(1, args.repeats // 2)))
        ten = prompt_body(10 * 10**6)
        result["refuse_10MB_prompt_precheck_s"] = statistics.median(
            timed_refusal(port, head(len(ten)), slices(ten), 400) for _ in range(max(1, args.repeats // 2)))
        # Idle, hostile, idle again (the machine's own noise shows as the gap between the two idle runs); the
        # hostile run measures within --header-timeout (10 s), before the server closes the slow connections.
        result["idle_latency_s"] = latency(port, 50, args.completions)
        socks, stop = hostile_connections(port, args.connections)
        time.sleep(0.5)
        hostile = latency(port, 50, 0)
        result["hostile_open_after_models_run"] = sum(1 for s in socks if _open(s))
        hostile.update({k: v for k, v in latency(port, args.completions, args.completions).items() if k != "models"})
        result["hostile_open_after_completions"] = sum(1 for s in socks if _open(s))
        result["latency_with_%d_hostile_connections_s" % args.connections] = hostile
        stop.set()
        for s in socks:
            s.close()
        result["idle_latency_again_s"] = latency(port, 50, args.completions)
    finally:
        proc.terminate()
        proc.wait(60)
    proc, port = start(["--max-request-bytes", str(64 * 2**20)])
    try:
        result["refuse_50MB_prompt_precheck_body_limit_64MiB_s"] = statistics.median(
            timed_refusal(port, head(len(big)), slices(big), 400) for _ in range(max(1, args.repeats // 2)))
    finally:
        proc.terminate()
        proc.wait(60)
    print(json.dumps(result, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
