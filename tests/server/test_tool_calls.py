"""Tool-call parsing in each model format, the grammar schemas of tool_choice, and parser choice (no model)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.server import tool_calls as tc

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


@pytest.mark.parametrize("parser, text, content", [
    ("hermes", 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Sure."),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "f", '
               '"arguments": {"a": 1}}</tool_call>', None),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', None),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', None),
])
def test_each_format_parses(parser, text, content):
    got_content, calls = tc.parse_tool_calls(parser, text)
    assert got_content == content and calls and all(c.name == "f" and json.loads(c.arguments) == {"a": 1}
                                                    for c in calls)


@pytest.mark.parametrize("parser, text", [
    ("hermes", "no call here"), ("hermes", "<tool_call>{broken</tool_call>"),
    ("mistral", "[TOOL_CALLS] nope"), ("llama3_json", "Hello {not json"), ("llama3_json", '{"x": 1}'),
])
def test_plain_text_stays_content(parser, text):
    assert tc.parse_tool_calls(parser, text) == (text, [])


def test_required_schema_accepts_calls_and_parses_back():
    schema = tc.required_schema([TOOL], parallel=False)
    good = [{"name": "f", "parameters": {"a": 3}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good * 2, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {"a": 3}}], schema)
    assert tc.parse_required(json.dumps(good))[0].arguments == '{"a": 3}'


def test_parser_choice_follows_the_template_and_the_override():
    class T:
        chat_template = "{{ '[TOOL_CALLS]' }}"

    assert tc.pick_parser(T(), None) == "mistral"
    assert tc.pick_parser(T(), "hermes") == "hermes"
    assert tc.pick_parser(None, None) == "hermes"
    with pytest.raises(ValueError):
        tc.pick_parser(T(), "nope")


def test_hermes_text_of_earlier_calls():
    text = tc.hermes_text([{"function": {"name": "f", "arguments": '{"a": 1}'}}])
    assert tc.parse_tool_calls("hermes", text)[1][0].name == "f"


def test_calls_complete_before_a_cut_come_back():
    call = {"name": "f", "parameters": {"a": 1}}
    whole = json.dumps([call, call, call])
    cut = whole[:whole.rindex("{") + 3]  # inside the third call
    assert [(c.name, json.loads(c.arguments)) for c in tc.array_prefix_calls(cut)] == [("f", {"a": 1})] * 2
    assert tc.array_prefix_calls('[{"name": "f", "parameters": {"a"') == []
    assert tc.array_prefix_calls("") == []
    block = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = tc.calls_before_cut("hermes", "Sure. " + block + block + '<tool_call>\n{"name": "f", "argu')
    assert content == "Sure." and len(calls) == 2
    assert tc.calls_before_cut("hermes", 'Sure. <tool_call>\n{"name"') == ('Sure. <tool_call>\n{"name"', [])
    content, calls = tc.calls_before_cut("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"na')
    assert content is None and len(calls) == 1
    content, calls = tc.calls_before_cut("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "f", "pa')
    assert content is None and len(calls) == 1
