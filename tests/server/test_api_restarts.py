"""The launcher replaces an API process that dies, after the engines have freed its requests, and gives up
(exit status 1) when one keeps dying: more than MAX_API_RESTARTS restarts within API_RESTART_WINDOW_S."""

from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace

from tandem.config import EngineConfig
from tandem.engine.messages import EngineInfo
from tandem.server import launcher
from tests.server.conftest import free_port


def crashing_api_process(*args) -> None:  # type: ignore[no-untyped-def]
    """Stands in for an API process that dies as soon as it starts."""
    raise SystemExit(3)


class FakeEngines:
    """One stand-in engine process; records the AbortClient commands the launcher sends."""

    def __init__(self) -> None:
        self.process = mp.get_context("spawn").Process(target=time.sleep, args=(120,), daemon=True)
        self.process.start()
        self.replicas = [SimpleNamespace(process=self.process, info=EngineInfo(256, 131, 8, self.process.pid),
                                         input_addr="ipc:///nonexistent/in")]
        self.output_addrs = ["ipc:///nonexistent/out-0"]
        self.info = self.replicas[0].info
        self.input_addrs = ["ipc:///nonexistent/in"]
        self.pids = [self.process.pid]
        self.processes = [self.process]
        self.aborted: list[int] = []

    def abort_client(self, client_index: int, skip=frozenset()) -> None:  # type: ignore[no-untyped-def]
        self.aborted.append(client_index)


def test_a_crash_looping_api_process_is_restarted_then_the_server_gives_up(monkeypatch):
    monkeypatch.setattr(launcher, "_api_process_main", crashing_api_process)
    monkeypatch.setattr(launcher, "MAX_API_RESTARTS", 1)
    engines = FakeEngines()
    try:
        settings = launcher.ApiSettings(EngineConfig(device="cpu"), ["m"], port=free_port(), graceful_timeout=1)
        started = time.monotonic()
        assert launcher._serve_with_api_processes(settings, engines, 1) == 1
        assert engines.aborted == [0]  # one restart, after the engines freed its requests; then no more
        assert time.monotonic() - started < 60
        assert engines.process.is_alive()  # the engines are the caller's to stop
    finally:
        engines.process.kill()
        engines.process.join(10)


def test_engine_timeout_must_cover_two_heartbeats():
    import pytest

    settings = launcher.ApiSettings(EngineConfig(device="cpu"), ["m"], port=free_port(), engine_timeout=1.0)
    with pytest.raises(ValueError, match="--engine-timeout must be at least 2 seconds"):
        launcher.serve(settings)
