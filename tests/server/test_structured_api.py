"""Structured output, tool calling and the sampling surface through the official openai client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL_NAME

CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(live_server):
    # Generous: the first constrained request also builds the grammar compiler's tokenizer tables.
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=live_server.api_key or "none", max_retries=0,
                         timeout=900.0)


def _check_call(call, tools=TOOLS) -> None:
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_response_format_json_schema_and_json_object(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=60, temperature=1.0, seed=1,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "p", "schema": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.completions.create(model=MODEL_NAME, prompt="JSON:", max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.lstrip().startswith("{")


def test_beta_parse_with_a_pydantic_model(client):
    r = client.beta.chat.completions.parse(model=MODEL_NAME, messages=CHAT, max_tokens=60, temperature=0,
                                           response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_guided_choice_and_regex(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Is the sky blue?", max_tokens=8, temperature=1.0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL_NAME, prompt="A code:", max_tokens=12, temperature=1.0,
                                  extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"})
    assert len(r.choices[0].text) == 4 and r.choices[0].text[:2].isupper()


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_specs_are_400_and_the_server_keeps_serving(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, extra_body=extra)
    assert param in str(info.value)
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0)
    assert r.choices[0].message.content


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_required_is_always_a_valid_call(client, temperature):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=temperature, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            _check_call(call)


def test_named_tool_choice_streams_arguments_and_reassembles(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}],
                                       tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    _check_call(call)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}],
                                            tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0,
                                            stream=True)
    name, args, finish, pieces = None, "", None, 0
    for ch in stream:
        delta = ch.choices[0].delta
        for tcd in delta.tool_calls or []:
            name = tcd.function.name or name
            if tcd.function.arguments:
                args += tcd.function.arguments
                pieces += 1
        finish = ch.choices[0].finish_reason or finish
    assert (name, args, finish) == ("get_weather", call.function.arguments, "tool_calls") and pieces > 1


def test_required_streamed_and_auto_and_none(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Time?"}],
                                            tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=80, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    for ch in stream:
        for tcd in ch.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tcd.index, {"name": None, "arguments": ""})
            entry["name"] = tcd.function.name or entry["name"]
            entry["arguments"] += tcd.function.arguments or ""
    assert calls and all(json.loads(c["arguments"]) is not None for c in calls.values())
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                           tools=TOOLS, tool_choice=choice, max_tokens=16, temperature=0)
        msg = r.choices[0].message
        assert msg.content or msg.tool_calls
        for call in msg.tool_calls or []:
            _check_call(call)


def test_multi_turn_with_tool_results(client):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=12,
                                       temperature=0)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_penalties_and_logit_bias_through_the_api(client, live_server):
    token = live_server.tokenizer.encode(" Paris")[0]
    base = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=4,
                                     temperature=0)
    banned = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=4,
                                       temperature=0, logit_bias={str(token): -100})
    assert "Paris" in base.choices[0].text and "Paris" not in banned.choices[0].text
    r = client.completions.create(model=MODEL_NAME, prompt="a a a a", max_tokens=6, temperature=0,
                                  presence_penalty=1.5, frequency_penalty=1.0,
                                  extra_body={"repetition_penalty": 1.3, "min_p": 0.1})
    assert r.choices[0].finish_reason in ("stop", "length")


def test_aborted_constrained_stream_frees_everything(client, live_server):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=150, temperature=1.0, stream=True,
        extra_body={"guided_json": {"type": "array", "items": {"type": "integer"}}, "ignore_eos": True})
    for i, _ in enumerate(stream):
        if i >= 3:
            break
    stream.close()
    metrics = live_server.wait_idle()
    assert metrics


# Tools and schemas as users write them, without additionalProperties: the strict reading is the default.
LOOSE_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
LOOSE_TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
LOOSE_TOOLS = [LOOSE_WEATHER, LOOSE_TIME]


def _check_strict_call(call) -> None:
    tool = next(t for t in LOOSE_TOOLS if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    assert set(args) <= set(tool["function"]["parameters"]["properties"]), args


def test_named_tool_arguments_hold_only_the_named_properties(client):
    # Read as plain JSON Schema, the model added keys the tool never mentioned until max_tokens.
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}],
                                       tools=LOOSE_TOOLS, tool_choice=choice, max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_strict_call(r.choices[0].message.tool_calls[0])
    loose_person = {k: v for k, v in PERSON.items() if k != "additionalProperties"}
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=60, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "p", "schema": loose_person}})
    person = json.loads(r.choices[0].message.content)
    assert set(person) <= {"name", "age"}, person


def test_required_parallel_calls_cut_by_max_tokens_come_back(client, live_server):
    # The model keeps the list of calls open (every token with a "]" banned) until max_tokens cuts it: the calls
    # complete before the cut are the response's tool_calls, finish_reason stays "length".
    tok = live_server.tokenizer
    no_close = {str(i): -100 for i in range(len(tok)) if "]" in tok.decode([i])}
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=LOOSE_TOOLS,
                  tool_choice="required", max_tokens=64, temperature=0, logit_bias=no_close)
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        _check_strict_call(call)
    calls: dict[int, dict] = {}
    finish = None
    for ch in client.chat.completions.create(**kwargs, stream=True):
        for tcd in ch.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tcd.index, {"name": None, "arguments": ""})
            entry["name"] = tcd.function.name or entry["name"]
            entry["arguments"] += tcd.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "length"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
