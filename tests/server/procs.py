"""`tandem serve` as a real process tree for the tests: start it, wait for /health, find and reap its children."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx

from tandem.bench.soak import process_tree
from tests.server.conftest import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_ENGINE_ARGS = ["--device", "cpu", "--max-model-len", "256", "--num-kv-blocks", "128"]


class ServeProcess:
    def __init__(self, log_path: str, *extra: str, log_level: str = "info", module: str = "tandem.cli") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", str(self.port),
             *CPU_ENGINE_ARGS, "--log-level", log_level, *extra],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_healthy(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.read_log()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up:\n" + self.read_log()
            time.sleep(0.25)

    def engine_pid(self) -> int:
        match = re.search(r"engine core ready \(pid (\d+)\)", self.read_log(tail=None))
        assert match, self.read_log()
        return int(match.group(1))

    def descendants(self) -> set[int]:
        return descendants(self.proc.pid)

    def read_log(self, tail: int | None = 6000) -> str:
        self.log.flush()
        self.log.seek(0)
        text = self.log.read()
        return text[-tail:] if tail else text

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc; zombies count as gone)."""
    return set(process_tree(pid)) - {pid}


def wait_gone(pids: set[int], timeout_s: float = 30) -> set[int]:
    """Waits until none of pids runs; returns those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {pid for pid in pids if _alive(pid)}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
