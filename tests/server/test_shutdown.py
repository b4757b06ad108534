"""`tandem serve` as a subprocess: SIGTERM stops accepting, lets the in-flight stream finish, exits 0. It serves a
tiny random model with a character tokenizer (up in seconds; on the CPU its 64-token stream outlasts the check that
new connections are refused)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.parallel.tiny_models import save_tiny, save_tiny_tokenizer
from tests.server.conftest import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sigterm_graceful_shutdown_exits_zero(tmp_path):
    model = save_tiny_tokenizer(save_tiny("llama", tmp_path / "llama"))
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--model", model, "--device", "cpu", "--max-model-len", "256", "--num-kv-blocks", "128",
         "--graceful-timeout", "60", "--log-level", "warning"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, _read(log)
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up:\n" + _read(log)
            time.sleep(0.25)

        first_chunk = threading.Event()
        events: list[str] = []

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(120), _read(log)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        try:  # new connections are refused while the in-flight stream goes on
            httpx.get(f"{url}/health", timeout=5)
            raise AssertionError("the server accepted a connection after SIGTERM")
        except httpx.TransportError:
            pass
        reader.join(timeout=120)
        assert not reader.is_alive()
        # The in-flight request finished normally.
        assert events[-1] == "[DONE]", events
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0, _read(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _read(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]
