"""The OpenAI API of `tandem serve` through the official openai client, bad inputs, auth, engine errors."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME, SHARED_SERVER_KWARGS

MAX_MODEL_LEN = SHARED_SERVER_KWARGS["max_model_len"]
TOO_LONG = "hello " * (MAX_MODEL_LEN + 1)  # a token a word at least: beyond the context
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(live_server):
    return live_server.openai()


def test_models_and_health(live_server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(f"{live_server.url}/health").status_code == 200


def test_completion_usage_and_streaming_agree(live_server, client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.text
    num_prompt = len(live_server.tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (num_prompt, 8, num_prompt + 8)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_and_streaming_chat(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0)
    message = r.choices[0].message
    assert message.role == "assistant" and message.content
    assert r.usage.completion_tokens <= 10 and r.usage.prompt_tokens > 10
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_stop_strings(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]  # a piece that most likely spans tokens
    assert stop.strip(), f"degenerate greedy text {full!r}"
    expected = full[:full.index(stop)]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "@@@"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert r.choices[0].text == expected + stop


def test_n_and_seed(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=7,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    assert len({c.text for c in r.choices}) > 1, "n samples should differ"
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, n=2, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_multiple_prompts_and_token_ids(live_server, client):
    ids = live_server.tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "Hello"], max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == next(c.text for c in r.choices if c.index == 0)
    two = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=2, temperature=0)
    assert len(two.choices) == 2


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-4)  # greedy picks the top token


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": TOO_LONG}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -7}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 10**6}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "seed": 2**80}, "seed"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "presence_penalty": 3.0}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 200}}, "logit_bias"),
    ({"prompt": "x", "ignore_eos": "true"}, "ignore_eos"),
]
BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": CHAT, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": 1}, "logprobs"),
]


def _check_400(response: httpx.Response, param: str | None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"] and (param is None or param.split("[")[0].split(".")[0] in error["message"]), error


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_input(live_server, body, param):
    _check_400(live_server.post("/v1/completions", json={"model": MODEL_NAME, **body}), param)


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_input(live_server, body, param):
    _check_400(live_server.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2, **body}), param)


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x", "model": "gpt-17"}),
                                       ("/v1/chat/completions", {"messages": CHAT, "model": "nope"})])
def test_unknown_model_is_404(live_server, path, body):
    r = live_server.post(path, json={"max_tokens": 2, **body})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found" and body["model"] in error["message"]


def test_bad_bodies_then_normal_request(live_server, client):
    for raw in (b"{not json", b"", b"[]", b"null", b'"text"', "{\"prompt\": \"\xff\"".encode("latin-1")):
        r = live_server.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
    assert "max_tokens" in str(info.value)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert r.choices[0].text is not None and r.usage.completion_tokens >= 1
    assert live_server.engine.num_requests == 0


def test_api_key(live_server):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{live_server.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{live_server.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert live_server.post("/v1/completions", json=body).status_code == 200


def test_unknown_route_is_openai_error(live_server):
    r = httpx.get(f"{live_server.url}/v1/nothing", headers=live_server.headers)
    assert r.status_code == 404 and "error" in r.json()


def test_engine_step_exception_fails_that_step_and_server_goes_on(live_server, client):
    live_server.inject_fault("launch")  # the engine core's next launch raises, as a device fault would
    r = live_server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and "injected device fault" in error["message"]
    # Streaming: the fault arrives as an SSE error event, then [DONE].
    live_server.inject_fault("launch")
    with httpx.stream("POST", f"{live_server.url}/v1/chat/completions", headers=live_server.headers, timeout=60,
                      json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "injected device fault" in json.loads(events[-2])["error"]["message"]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(f"{live_server.url}/health").status_code == 200


def test_step_raising_outside_the_core_guard_fails_live_requests(live_server, client):
    """If EngineCore.step itself raises, the engine-core loop fails every request it holds and keeps serving."""
    live_server.inject_fault("step")
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3)
    assert "injected step crash" in str(info.value)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3)
    assert r.usage.completion_tokens >= 1
    m = live_server.wait_idle()
    assert m["tandem_kv_cache_usage_ratio"] == 0 and m["tandem_request_failure_total"] >= 1
