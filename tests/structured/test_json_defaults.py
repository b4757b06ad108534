"""JSON schemas read strictly by default (an object generates only the properties it names, a tuple only its items),
under both grammar backends, and the JSON-Schema reading with strict_json_schema=False / --no-strict-json-schema."""

from __future__ import annotations

import argparse
import json

import pytest

from tandem.sampling_params import StructuredOutputParams
from tandem.structured.grammar import GrammarCache
from tandem.structured.json_schema import prepare_json_schema
from tandem.structured.matcher import HostMask

OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _strict(schema: dict) -> dict:
    return json.loads(prepare_json_schema(json.dumps(schema), strict=True, bound_digits=False))


def test_strict_closes_objects_that_name_their_properties():
    schema = {"type": "object", "properties": {
        "inner": {"type": "object", "properties": {"x": {"type": "string"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
        "free": {"type": "object"},  # names no property: any object, as before
        "properties": {"type": "object", "properties": {"y": {}}},  # a property named like the keyword
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
        "list": {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}},
        "$defs": {"D": {"type": "object", "properties": {"z": {}}}},
        "enum": [{"properties": {}}]}  # data, not a schema
    out = _strict(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False and props["inner"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in props["free"]
    assert props["properties"]["additionalProperties"] is False
    assert props["pair"]["items"] is False and props["list"]["items"] == {"type": "string"}
    assert out["$defs"]["D"]["additionalProperties"] is False and out["enum"] == schema["enum"]
    assert "additionalProperties" not in props["properties"]["properties"]  # the name map itself is no schema


def test_strict_leaves_combined_subschemas_alone():
    # The branches of allOf (and anyOf beside the parent's own properties) describe one object together: closing
    # each would refuse the properties the others name.
    all_of = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert _strict(all_of) == all_of
    mixed = {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}, {"required": ["a"]}]}
    assert _strict(mixed) == mixed
    alternatives = {"anyOf": [{"properties": {"a": {}}}, {"type": "integer"}]}
    assert _strict(alternatives)["anyOf"][0]["additionalProperties"] is False
    cond = {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"properties": {"b": {}}}}
    assert _strict(cond) == cond


def _accepts(cache: GrammarCache, schema: dict, text: str) -> bool:
    """Whether the grammar takes `text` character by character (the synthetic vocabulary starts with ASCII)."""
    mask = HostMask(cache.submit(StructuredOutputParams(json=json.dumps(schema))).result())
    return all(mask.accept(ord(c) - 32) for c in text)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_both_backends_read_the_schema_strictly_unless_told(backend):
    strict = GrammarCache(None, 300, [299], backend_name=backend)
    plain = GrammarCache(None, 300, [299], backend_name=backend, strict_json_schema=False)
    try:
        for cache in (strict, plain):
            assert _accepts(cache, OBJECT, '{"a": 1}')
            assert _accepts(cache, {"type": "object"}, '{"b": 2}')  # names nothing: any object either way
        assert not _accepts(strict, OBJECT, '{"a": 1, "b": 2}')
        assert _accepts(plain, OBJECT, '{"a": 1, "b": 2}')
        tuple_schema = {"type": "array", "prefixItems": [{"type": "integer"}]}
        assert not _accepts(strict, tuple_schema, "[1, 2]") and _accepts(plain, tuple_schema, "[1, 2]")
    finally:
        strict.shutdown()
        plain.shutdown()


def test_strict_json_schema_flag():
    from tandem.config import EngineConfig
    from tandem.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["strict_json_schema"] is True
    assert engine_kwargs(parser.parse_args(["--no-strict-json-schema"]))["strict_json_schema"] is False
    assert EngineConfig().strict_json_schema is True
