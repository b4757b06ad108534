"""Live-server fixtures: an engine-core process + an API app on 127.0.0.1 serving the embedded model (one shared by
the modules of tests/server that need no settings of their own)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.flaky_core import FAULT_DIR_ENV

MODEL_NAME = "smol-test"
# Small and CPU-friendly: short context (cheap "beyond the context" checks), a small KV pool.
ENGINE_KWARGS = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=256, max_num_seqs=64)
API_KEY = "test-key-123"
# The shared server's settings: an API key (the auth checks; every other test sends it) and room for the tools'
# system prompt of the structured-output tests. Starting a server takes ~40 s on 2 cores, so one serves them all.
SHARED_SERVER_KWARGS = dict(api_key=API_KEY, max_model_len=768)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    app: Any
    server: Any
    thread: threading.Thread
    api_key: str | None
    engines: Any  # tandem.engine.launch.Engines
    tokenizer: Any
    fault_dir: str

    @property
    def engine(self) -> Any:
        """This API process's AsyncEngine (the client of the engine-core process)."""
        return self.app.state.engine

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def inject_fault(self, kind: str, times: int = 1) -> None:
        """Makes the engine core's next `times` launches ('launch') or step() calls ('step') raise."""
        with open(os.path.join(self.fault_dir, kind), "w") as f:
            f.write(str(times))

    def openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=120.0, **kwargs)

    def post(self, path: str, timeout: float = 120.0, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(f"{self.url}{path}", headers=headers, timeout=timeout, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Flat {'name{label="v"}': value} of /metrics."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=30).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, float]:
        """Waits until the engine holds nothing (no requests, no KV blocks); returns /metrics then."""
        assert self.engine.stats is not None, "EngineCore.stats() failed: /metrics would report zeros"
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m["tandem_num_requests_running"] == 0 and m["tandem_num_requests_waiting"] == 0
                    and m["tandem_kv_cache_usage_ratio"] == 0 and m["tandem_num_requests_in_server"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


def start_server(api_key: str | None = None, max_queue: int = 128, api_settings: dict[str, Any] | None = None,
                 **engine_kwargs: Any) -> LiveServer:
    """The engine core in its own process (as `tandem serve` runs it) and the API app in a uvicorn thread here;
    api_settings: more ApiSettings fields."""
    from tandem.config import EngineConfig
    from tandem.engine.launch import start_engines
    from tandem.server.launcher import ApiSettings, EngineEndpoints, build_api_server, load_tokenizer_soon

    fault_dir = tempfile.mkdtemp(prefix="tandem-faults-")
    os.environ[FAULT_DIR_ENV] = fault_dir  # inherited by the engine-core process
    config = EngineConfig(**{**ENGINE_KWARGS, **engine_kwargs})
    tokenizer = load_tokenizer_soon(config)  # while the engine process starts, as `tandem serve` does
    engines = start_engines(config, max_queue=max_queue, log_level="warning",
                            core_class="tests.server.flaky_core:FlakyEngineCore")
    settings = ApiSettings(config, [MODEL_NAME], port=free_port(), api_key=api_key, max_queue=max_queue,
                           graceful_timeout=5, log_level="warning", **(api_settings or {}))
    server, app, _ = build_api_server(settings, EngineEndpoints.of(engines, 0), tokenizer=tokenizer)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            engines.stop()
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return LiveServer(f"http://127.0.0.1:{settings.port}", app, server, thread, api_key, engines,
                      app.state.serving.tokenizer, fault_dir)


def stop_server(live: LiveServer) -> None:
    live.server.should_exit = True
    live.thread.join(timeout=30)
    assert not live.thread.is_alive(), "the test server did not shut down"
    assert live.engines.stop() == 0, "the engine core did not exit cleanly"
    shutil.rmtree(live.fault_dir, ignore_errors=True)


@pytest.fixture(scope="package")
def live_server():
    """One server (SHARED_SERVER_KWARGS) for every module of tests/server that uses it; a module that needs other
    settings starts its own with start_server. Tests leave it as they found it: idle, default max_queue, no fault
    pending."""
    live = start_server(**SHARED_SERVER_KWARGS)
    yield live
    stop_server(live)
