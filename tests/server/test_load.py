"""The server under load: concurrent streams with disconnects, a full queue, a bounded load run, fuzzed bodies."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.server.conftest import API_KEY, MODEL_NAME

NUM_CLIENTS = 50
NUM_DISCONNECT = 12  # every fourth client (up to 12) hangs up after two chunks
MAX_TOKENS = 8
# What the hanging-up clients ask for: more than they could get before the server sees them go (with 8, a run
# saw all of them finish first, counted as "length" rather than aborted).
DISCONNECT_MAX_TOKENS = 200  # with the prompt, within the test server's max_model_len


async def _stream_one(client: httpx.AsyncClient, i: int, disconnect: bool) -> dict:
    max_tokens = DISCONNECT_MAX_TOKENS if disconnect else MAX_TOKENS
    body = {"model": MODEL_NAME, "prompt": f"Story number {i}:", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    texts, usage, finish = [], None, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["usage"]:
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                texts.append(choice["text"])
                finish = choice["finish_reason"] or finish
            if disconnect and len(texts) >= 2:
                break  # leaving the block closes the connection mid-stream
    return {"i": i, "text": "".join(texts), "usage": usage, "finish": finish, "disconnected": disconnect}


def test_concurrent_streams_with_disconnects(live_server):
    tokenizer = live_server.tokenizer
    before = live_server.metrics()
    disconnecting = set(range(0, NUM_CLIENTS, 4)[:NUM_DISCONNECT])

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 5)
        async with httpx.AsyncClient(base_url=live_server.url, limits=limits, timeout=240,
                                     headers=live_server.headers) as client:
            tasks = [_stream_one(client, i, i in disconnecting) for i in range(NUM_CLIENTS)]
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)

    results = asyncio.run(main())
    completed = [r for r in results if not r["disconnected"]]
    assert len(completed) == NUM_CLIENTS - NUM_DISCONNECT
    for r in completed:
        assert r["finish"] == "length", r
        assert r["usage"]["completion_tokens"] == MAX_TOKENS, r
        assert r["text"]
    after = live_server.wait_idle()
    assert after["tandem_kv_cache_usage_ratio"] == 0, "blocks of aborted requests were not freed"
    assert after["tandem_num_requests_running"] == 0 and after["tandem_num_requests_waiting"] == 0
    assert live_server.engine.num_requests == 0

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('tandem_request_success_total{finished_reason="length"}') == len(completed)
    assert delta('tandem_request_success_total{finished_reason="abort"}') == NUM_DISCONNECT
    assert delta("tandem_prompt_tokens_total") == sum(
        len(tokenizer.encode(f"Story number {i}:")) for i in range(NUM_CLIENTS))
    generated = delta("tandem_generation_tokens_total")
    assert (len(completed) * MAX_TOKENS + 2 * NUM_DISCONNECT <= generated
            < len(completed) * MAX_TOKENS + NUM_DISCONNECT * DISCONNECT_MAX_TOKENS)
    assert delta("tandem_time_to_first_token_seconds_count") == NUM_CLIENTS
    assert delta("tandem_e2e_request_latency_seconds_count") == NUM_CLIENTS


def test_non_streaming_client_disconnect_aborts(live_server):
    before = live_server.metrics()
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes the connection
        live_server.post("/v1/completions", json=body, timeout=1.0)
    after = live_server.wait_idle(timeout_s=30)
    assert after["tandem_kv_cache_usage_ratio"] == 0 and live_server.engine.num_requests == 0
    aborted = 'tandem_request_success_total{finished_reason="abort"}'
    assert after[aborted] - before[aborted] == 1
    assert after["tandem_generation_tokens_total"] - before["tandem_generation_tokens_total"] < 200


def test_full_queue_answers_429_at_once(live_server):
    engine = live_server.engine
    max_queue, engine.max_queue = engine.max_queue, 2
    try:
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=live_server.url, timeout=120, headers=live_server.headers) as client:
            with client.stream("POST", "/v1/completions", json=body) as first, \
                    client.stream("POST", "/v1/completions", json=body) as second:
                assert first.status_code == second.status_code == 200
                start = time.monotonic()
                third = live_server.post("/v1/completions", timeout=30,
                                         json={**body, "stream": False, "max_tokens": 2})
                assert third.status_code == 429, third.text
                assert time.monotonic() - start < 5
                assert third.json()["error"]["type"] == "rate_limit_error"
                for s in (first, second):  # the accepted ones still complete
                    lines = [line for line in s.iter_lines() if line.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]"
    finally:
        engine.max_queue = max_queue
    r = live_server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


@pytest.mark.parametrize("num_clients", [1, 2])
def test_bounded_load_with_bench_serve(live_server, tmp_path, num_clients):
    """A fixed count of requests on a fixed schedule through `tandem bench serve` (one or two client
    processes, results merged); all must complete."""
    from tandem.bench.serve import add_bench_serve_args, bench_serve_main

    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--base-url", live_server.url, "--num-requests", "24", "--request-rate", "20",
                              "--max-tokens", "6", "--max-concurrency", "16", "--warmup", "1",
                              "--prompt", "Hello", "--prompt", "Tell me a story", "--timeout", "120",
                              "--num-clients", str(num_clients), "--api-key", API_KEY, "--out", str(out)])
    start = time.monotonic()
    assert bench_serve_main(args) == 0
    assert time.monotonic() - start < 150
    summary = json.loads(out.read_text())["summary"]
    assert summary["num_completed"] == 24 and summary["num_failed"] == 0
    assert summary["output_tokens"] == 24 * 6
    for name in ("ttft_s", "tpot_s", "itl_s", "latency_s"):
        d = summary[name]
        assert 0 < d["p50"] <= d["p95"] <= d["p99"] <= d["max"], (name, d)
    assert summary["output_tokens_per_s"] > 0
    assert live_server.wait_idle()["tandem_kv_cache_usage_ratio"] == 0


# ---- fuzzing --------------------------------------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                  st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=10)
# A third of the bodies are valid (every field in range) and reach the engine, a third are a valid
# body with one field replaced by arbitrary JSON (each probes one field's validation), a third are
# known keys with arbitrary JSON values.
# Token budgets stay tiny so accepted requests finish fast on the CPU.
valid_common = {
    "model": st.just(MODEL_NAME),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "n": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
    "seed": st.integers(0, 2**63 - 1),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "skip_special_tokens": st.booleans(),
    "min_tokens": st.integers(0, 1),
}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": st.text(max_size=30)})
prompt = st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 49151), min_size=1, max_size=8),
                   st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3))


def _consistent(body: dict) -> dict:
    if not body.get("stream"):
        body.pop("stream_options", None)
    if "top_logprobs" in body and not body.get("logprobs"):
        body.pop("top_logprobs")
    return body


def _fuzzed(valid: st.SearchStrategy) -> st.SearchStrategy:
    keys = sorted({*valid_common, "prompt", "messages", "max_tokens", "max_completion_tokens", "logprobs",
                   "top_logprobs", "echo", "best_of", "n", "unknown_field"})
    corrupted = st.tuples(valid, st.sampled_from(keys), json_values).map(lambda t: {**t[0], t[1]: t[2]})
    wild = st.dictionaries(st.sampled_from(keys), json_values, max_size=6)
    return st.one_of(corrupted, wild, valid)


completion_bodies = _fuzzed(st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 3), "prompt": prompt},
    optional={**valid_common, "logprobs": st.integers(0, 5)}).map(_consistent))
chat_bodies = _fuzzed(st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 3), "messages": st.lists(message, min_size=1, max_size=3)},
    optional={**valid_common, "max_completion_tokens": st.integers(1, 3), "logprobs": st.booleans(),
              "top_logprobs": st.integers(0, 5)}).map(_consistent))


def _post_and_check(live_server, path: str, body: object) -> None:
    try:
        raw = json.dumps(body).encode()
    except (TypeError, ValueError):
        return
    with httpx.Client(base_url=live_server.url, timeout=120, headers=live_server.headers) as client:
        with client.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as r:
            content = r.read().decode()
    assert r.status_code < 500, (body, r.status_code, content)
    if r.status_code == 404:  # a fuzzed "model" that names no served model (or adapter): the OpenAI 404
        assert isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] != MODEL_NAME, content
        assert json.loads(content)["error"]["code"] == "model_not_found", content
    elif r.status_code != 200:
        assert r.status_code in (400, 429) and "error" in json.loads(content), content
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert content.rstrip().endswith("data: [DONE]"), content
        assert '"error"' not in content, content
    else:
        assert json.loads(content)["choices"], content


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(body=completion_bodies)
def test_fuzz_completion_bodies(live_server, body):
    body.setdefault("model", MODEL_NAME)
    _post_and_check(live_server, "/v1/completions", body)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(body=chat_bodies)
def test_fuzz_chat_bodies(live_server, body):
    body.setdefault("model", MODEL_NAME)
    _post_and_check(live_server, "/v1/chat/completions", body)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzz_raw_bytes(live_server, raw, path):
    r = live_server.post(path, content=raw, timeout=60)
    assert r.status_code == 400 or (r.status_code == 200 and raw), (raw, r.text)


def test_server_healthy_after_fuzzing(live_server):
    m = live_server.wait_idle()
    assert m["tandem_kv_cache_usage_ratio"] == 0 and live_server.engine.num_requests == 0
    assert httpx.get(f"{live_server.url}/health").status_code == 200
    r = live_server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
