"""The process split as users run it: the engine core killed mid-stream, several API processes, no orphans. Each
serves a tiny random model with a character tokenizer, which starts in seconds (the embedded model takes ~40 s on
2 CPU cores); on the CPU it streams 200 tokens over several seconds, so the kill lands mid-stream."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.parallel.tiny_models import save_tiny, save_tiny_tokenizer
from tests.server.procs import ServeProcess, wait_gone


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_tokenizer(save_tiny("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture
def serve_factory(tmp_path):
    started: list[ServeProcess] = []

    def start(*extra: str) -> ServeProcess:
        server = ServeProcess(str(tmp_path / f"server-{len(started)}.log"), *extra)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def test_engine_killed_mid_stream_fails_requests_and_the_server_exits_nonzero(serve_factory, tiny_model):
    server = serve_factory("--model", tiny_model)
    server.wait_healthy()
    children = server.descendants()
    engine_pid = server.engine_pid()
    assert engine_pid in children
    events: list[str] = []
    first = threading.Event()
    done = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()
        finally:
            done.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(120), server.read_log()
    os.kill(engine_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert done.wait(10), "the open stream did not end after the engine died"
    assert time.monotonic() - killed_at < 5
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine core process" in error["message"] and "died" in error["message"]
    try:  # /health says so while the server is still up (then it exits)
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503, health.text
    except httpx.TransportError:
        pass
    assert server.proc.wait(timeout=60) != 0, server.read_log()
    assert not wait_gone(children), "a child of tandem serve outlived it"


def _complete(url: str, i: int) -> dict:
    body = {"prompt": f"Item {i}:", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def test_two_api_processes_serve_and_count_across_processes_then_shut_down_clean(serve_factory, tiny_model):
    server = serve_factory("--model", tiny_model, "--api-server-count", "2")
    server.wait_healthy()
    children = server.descendants()
    assert len(children) >= 3  # the engine core and two API processes (plus multiprocessing's tracker)
    # Both SO_REUSEPORT sockets listen as soon as the server answers at all (the launcher binds them before
    # the API processes start), so early kept-alive connections cannot all pile onto the first process up.
    assert _num_listeners(server.port) == 2
    num = 12
    results: list[dict] = []
    threads = [threading.Thread(target=lambda i=i: results.append(_complete(server.url, i))) for i in range(num)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == num and all(r["usage"]["completion_tokens"] == 4 for r in results)
    # Whichever process answers /metrics, the counts are the whole server's.
    for _ in range(4):
        assert _metric(server.url, "tandem_request_success_total") == num
        assert _metric(server.url, "tandem_generation_tokens_total") == 4 * num
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=90) == 0, server.read_log()
    assert not wait_gone(children), "a child of tandem serve outlived it"
    leftover = [line for line in server.read_log(tail=None).splitlines() if "Traceback" in line]
    assert not leftover, server.read_log()


def test_adapters_loaded_at_run_time_reach_every_api_process(serve_factory, tiny_model, tmp_path):
    """Two API processes with LoRA on: an adapter loaded through one is served by both (each request on a new
    connection, which the kernel spreads over the two sockets), listed by both, and once unloaded through either,
    refused by both."""
    pytest.importorskip("peft")
    from tests.lora.adapters import save_adapter

    path = save_adapter(tiny_model, str(tmp_path / "sql"), ["q_proj", "down_proj"], r=4, seed=1)
    server = serve_factory("--model", tiny_model, "--api-server-count", "2", "--enable-lora", "--max-lora-rank", "8")
    server.wait_healthy()
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path}, timeout=60)
    assert r.status_code == 200, r.text
    body = {"model": "sql", "prompt": "Item 1:", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    answers = [httpx.post(f"{server.url}/v1/completions", json=body, timeout=120) for _ in range(12)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
    for _ in range(6):
        assert "sql" in [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]]
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=60)
    assert r.status_code == 200, r.text
    assert [httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code
            for _ in range(12)] == [404] * 12
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=90) == 0, server.read_log()


def test_bad_model_path_exits_nonzero_with_the_reason(serve_factory):
    server = serve_factory("--model", "/no/such/model")
    assert server.proc.wait(timeout=120) != 0
    assert "/no/such/model" in server.read_log()


def test_data_parallel_two_engine_replicas_serve_every_request_once(serve_factory, tiny_model):
    server = serve_factory("--model", tiny_model, "--data-parallel-size", "2", "--num-kv-blocks", "64")
    server.wait_healthy()
    log = server.read_log(tail=None)
    assert log.count("engine core ready") == 2, log
    assert _num_listeners(server.port) == 2  # no --api-server-count: one API process per replica
    children = server.descendants()
    shared = "You are a helpful assistant. Answer briefly and plainly, in one short sentence please. " * 2
    prompts = [f"{shared}Question {i}: what is {i} plus {i}?" for i in range(6)] + [f"Item {i}:" for i in range(6)]
    results: dict[int, dict] = {}

    def one(i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        results[i] = r.json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert sorted(results) == list(range(len(prompts)))
    assert all(r["usage"]["completion_tokens"] == 4 for r in results.values())
    assert _metric(server.url, "tandem_request_success_total") == len(prompts)
    # Both replicas' KV pools are counted (64 blocks each); all freed once idle.
    assert _metric(server.url, "tandem_kv_cache_usage_ratio") == 0
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=90) == 0, server.read_log()
    assert not wait_gone(children), "a child of tandem serve outlived it"


def _num_listeners(port: int) -> int:
    """Listening TCP sockets on `port` (IPv4 and IPv6), from /proc/net/tcp*."""
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: TCP_LISTEN
                count += 1
    return count
