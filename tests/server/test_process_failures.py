"""`tandem serve --api-server-count 2 --data-parallel-size 2` as users run it, on a tiny model: an API process
killed under load is replaced and no request is lost; an engine replica killed mid-stream fails only its own
requests; the last replica stopped (SIGSTOP) makes /health unhealthy and its open request end within
--engine-timeout, and it rejoins on SIGCONT; SIGTERM still shuts everything down cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.parallel.tiny_models import save_tiny
from tests.server.procs import ServeProcess, descendants, wait_gone
from tests.server.test_processes import _metric

ENGINE_TIMEOUT_S = 3.0
PROMPT = [5, 6, 7, 8, 9, 10]  # the tiny model has no tokenizer: prompts are token ids


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def _by_name(root: int, prefix: str) -> dict[str, int]:
    found = {}
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith(prefix):
            found[name] = pid
    return found


def _complete(url: str, max_tokens: int = 4) -> dict:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


class Stream(threading.Thread):
    """One streamed completion: its token events, its error event if any, how it ended."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.tokens = 0
        self.finish: str | None = None
        self.error: dict | None = None
        self.broken: str | None = None
        self.first = threading.Event()
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        body = {"prompt": PROMPT, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]
                        continue
                    choice = event["choices"][0]
                    self.tokens += len(choice.get("token_ids") or [])
                    self.finish = choice["finish_reason"] or self.finish
                    self.first.set()
        except httpx.TransportError as exc:
            self.broken = repr(exc)
        finally:
            self.ended_at = time.monotonic()
            self.first.set()


def test_api_and_engine_process_failures_are_contained(tiny_llama, tmp_path):
    server = ServeProcess(str(tmp_path / "server.log"), "--model", tiny_llama, "--api-server-count", "2",
                          "--data-parallel-size", "2", "--engine-timeout", str(ENGINE_TIMEOUT_S))
    try:
        server.wait_healthy()
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        assert health == {"status": "ok", "replicas": {"live": 2, "total": 2}}
        children = server.descendants()
        engines = [int(p) for p in re.findall(r"engine core ready \(pid (\d+)\)", server.read_log(tail=None))]
        assert len(engines) == 2
        apis = _by_name(server.proc.pid, "tandem-api-")
        assert set(apis) == {"tandem-api-0", "tandem-api-1"}

        # 1. An API process killed under load: replaced within 5 s; the next 20 requests all answered.
        # SO_REUSEPORT spreads connections by a hash of their addresses: with 16 streams the odds that none lands
        # on the process that survives are 2^-16 (with 6 they were 1 in 64, and it happened).
        streams = [Stream(server.url, 150) for _ in range(16)]
        assert all(s.first.wait(120) for s in streams), server.read_log()
        os.kill(apis["tandem-api-1"], signal.SIGKILL)
        killed_at = time.monotonic()
        while "API process 1 replaced" not in server.read_log(tail=None):
            assert time.monotonic() - killed_at < 5, "the dead API process was not replaced within 5 s\n" + \
                server.read_log()
            time.sleep(0.05)
        results: list[dict] = []
        load = [threading.Thread(target=lambda: results.append(_complete(server.url))) for _ in range(20)]
        for t in load:
            t.start()
        for t in load:
            t.join(180)
        assert len(results) == 20 and all(r["usage"]["completion_tokens"] == 4 for r in results)
        for s in streams:
            s.join(120)
        # A stream on the killed process lost its connection; every other one ran to its end.
        assert all(s.broken is not None or (s.finish == "length" and s.tokens == 150) for s in streams)
        assert any(s.broken is None for s in streams) and not any(s.error for s in streams)
        assert _metric(server.url, "tandem_api_server_restarts") == 1

        # 2. Replica 1 killed mid-stream: its streams end with an error at once, the others finish.
        streams = [Stream(server.url, 240) for _ in range(8)]
        assert streams[-1].first.wait(120), server.read_log()
        os.kill(engines[1], signal.SIGKILL)
        killed_at = time.monotonic()
        for s in streams:
            s.join(120)
        failed = [s for s in streams if s.error is not None]
        assert failed and len(failed) < len(streams)
        for s in failed:
            assert "engine replica 1" in s.error["message"] and "died" in s.error["message"], s.error
            assert s.error["code"] == 503 and s.ended_at - killed_at < 5
        assert all(s.finish == "length" and s.tokens == 240 for s in streams if s.error is None)
        for _ in range(4):  # whichever API process answers
            r = httpx.get(f"{server.url}/health", timeout=10)
            assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
            assert r.json()["replicas"] == {"live": 1, "total": 2}
            assert r.json()["down"][0]["replica"] == 1 and r.json()["down"][0]["state"] == "dead"
        assert all(_complete(server.url)["usage"]["completion_tokens"] == 4 for _ in range(6))
        assert _metric(server.url, "tandem_engine_replicas_live") == 1
        assert _metric(server.url, "tandem_engine_replica_failures") == 1

        # 3. The last replica stopped: its stream errors and /health fails within --engine-timeout; SIGCONT: back.
        stream = Stream(server.url, 240)
        assert stream.first.wait(60)
        os.kill(engines[0], signal.SIGSTOP)
        stopped_at = time.monotonic()
        stream.join(30)
        assert stream.error is not None and "sent nothing" in stream.error["message"], stream.error
        assert stream.ended_at - stopped_at < ENGINE_TIMEOUT_S + 3
        deadline = time.monotonic() + ENGINE_TIMEOUT_S + 3
        while httpx.get(f"{server.url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 with the engine stopped"
            time.sleep(0.2)
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
        os.kill(engines[0], signal.SIGCONT)
        deadline = time.monotonic() + 10
        while not all(httpx.get(f"{server.url}/health", timeout=10).status_code == 200 for _ in range(4)):
            assert time.monotonic() < deadline, "the resumed engine did not rejoin"
            time.sleep(0.2)
        assert _complete(server.url)["usage"]["completion_tokens"] == 4

        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=90) == 0, server.read_log()
        assert not wait_gone(children | set(_by_name(server.proc.pid, "tandem").values())), \
            "a child of tandem serve outlived it"
    finally:
        server.close()


def test_tensor_parallel_replicas_behind_one_server(tiny_llama, tmp_path):
    """`--tensor-parallel-size 2 --data-parallel-size 2`: four gloo ranks, two replicas of two behind two API
    processes, give eight concurrent requests (routed by load over the replicas) the greedy tokens of one
    offline engine, and SIGTERM stops every rank (exit 0, no process left)."""
    from tandem import LLM, SamplingParams

    prompts = [[(5 * i + j) % 60 + 4 for j in range(3 + i)] for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_llama, device="cpu", max_model_len=256, num_kv_blocks=128) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    server = ServeProcess(str(tmp_path / "server.log"), "--model", tiny_llama, "--tensor-parallel-size", "2",
                          "--data-parallel-size", "2")
    try:
        server.wait_healthy()
        assert httpx.get(f"{server.url}/health", timeout=10).json()["replicas"] == {"live": 2, "total": 2}
        children = server.descendants()
        assert server.read_log(tail=None).count("engine core ready") == 2
        got: dict[int, list[int]] = {}

        def one(i: int) -> None:
            body = {"prompt": prompts[i], "max_tokens": 6, "ignore_eos": True, "temperature": 0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            got[i] = r.json()["choices"][0]["token_ids"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [got.get(i) for i in range(len(prompts))] == expected
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=90) == 0, server.read_log()
        assert not wait_gone(children), "a rank or API process of tandem serve outlived it"
    finally:
        server.close()
