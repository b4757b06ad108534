"""Tool calling: the model's own call format (Hermes / Qwen, Llama 3 JSON, Mistral), parsed out of the output;
the grammars that enforce `tool_choice` "required" or a named function; tool-aware chat messages."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def pick_parser(tokenizer: Any, override: str | None) -> str:
    """The parser named on the command line, else the one the chat template's own format suggests."""
    if override:
        if override not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {override!r}")
        return override
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def start_marker(parser: str) -> str:
    """Text that opens a tool call in the model's output (streaming holds text back from here on)."""
    return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{"}[parser]


def _call_of(obj: Any) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_of(value: Any) -> list[ParsedCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item) for item in items]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content outside the calls or None, the calls) of a finished output; no calls: (text, [])."""
    if parser == "hermes":
        blocks = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, flags=re.S)
        calls: list[ParsedCall] = []
        for block in blocks:
            try:
                found = _calls_of(json.loads(block))
            except json.JSONDecodeError:
                found = None
            if found is None:
                return text, []
            calls += found
        content = text.split("<tool_call>", 1)[0].strip() if calls else text
        return (content or None) if calls else text, calls
    if parser == "mistral":
        if "[TOOL_CALLS]" not in text:
            return text, []
        head, tail = text.split("[TOOL_CALLS]", 1)
        try:
            found = _calls_of(json.loads(tail.strip()))
        except json.JSONDecodeError:
            found = None
        return (head.strip() or None, found) if found else (text, [])
    # llama3_json: the whole output is one JSON call (or several separated by ';'), optionally after <|python_tag|>
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    try:
        found = [c for part in body.split(";") if part.strip() for c in (_calls_of(json.loads(part)) or [None])]
    except json.JSONDecodeError:
        return text, []
    if not found or any(c is None for c in found):
        return text, []
    return None, found  # type: ignore[return-value]


def calls_before_cut(parser: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content before the calls or None, the calls complete in it) of an output cut by max_tokens: a call whose
    text the cut ended is left out, the ones before it come back; none complete: (text, [])."""
    if parser == "hermes":
        closed = text[:text.rfind("</tool_call>") + len("</tool_call>")] if "</tool_call>" in text else ""
        content, calls = parse_tool_calls(parser, closed) if closed else (text, [])
        return (content, calls) if calls else (text, [])
    if parser == "mistral":
        head, marker, tail = text.partition("[TOOL_CALLS]")
        calls = array_prefix_calls(tail) if marker else []
        return (head.strip() or None, calls) if calls else (text, [])
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = []
    for part in body.split(";"):
        try:
            found = _calls_of(json.loads(part))
        except json.JSONDecodeError:
            found = None
        if found is None:
            break
        calls += found
    return (None, calls) if calls else (text, [])


def array_prefix_calls(text: str) -> list[ParsedCall]:
    """The calls complete in a JSON array of calls that may be cut anywhere (required_schema's output, Mistral's
    list): every element before the first one that does not parse whole."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        return []
    calls: list[ParsedCall] = []
    pos += 1
    while True:
        while text[pos:pos + 1].isspace():
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return calls
        call = _call_of(item)
        if call is None:
            return calls
        calls.append(call)
        while text[pos:pos + 1].isspace():
            pos += 1
        if text[pos:pos + 1] != ",":
            return calls
        pos += 1


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls {"name": ..., "parameters": {...}} to any of the tools (one, unless parallel)."""
    one_of = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                "parameters": function_parameters(t)},
               "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[ParsedCall]:
    """The calls of an output generated under required_schema (grammar-enforced, so it parses)."""
    items = json.loads(text)
    return [ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


def hermes_text(calls: list[dict[str, Any]]) -> str:
    """Earlier assistant tool calls written in the Hermes format, for templates that do not render tool_calls."""
    out = []
    for call in calls:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        except json.JSONDecodeError:
            args = fn["arguments"]
        out.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}) + "\n</tool_call>")
    return "\n".join(out)


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """Tool descriptions in the Hermes system-prompt style, for templates that take no `tools`."""
    signatures = "\n".join(json.dumps(t, separators=(",", ":")) for t in tools)
    return ("You may call one or more functions to assist with the user query. You are provided with function "
            f"signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\nFor each function call, "
            "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
