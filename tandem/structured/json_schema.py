"""JSON schemas as the grammar backends get them: the strict reading (an object generates only the properties it
names) and at most 6 digits after the point in a ranged number, applied to the user's schema before it compiles."""

from __future__ import annotations

import json
from typing import Any

# A number with a range has at most this many digits after the point, as under xgrammar's JSON grammar.
NUMBER_FRACTION_DIGITS = 6
# Keywords whose value maps names to schemas (the map itself is no schema), and keywords whose value is data.
_MAP_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "x-guidance"})
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Subschemas that the validator combines with their parent (or with each other) on the same instance: an object's
# properties may be named by any of them, so the strict reading leaves these subschemas, and their parent, alone.
_COMBINED_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "if", "then", "else", "not", "$ref",
                                "dependentSchemas"})
# Of those, the ones whose subschemas always meet their parent's other keywords (anyOf / oneOf branches are whole
# alternatives unless the parent names properties of its own).
_ALWAYS_COMBINED = frozenset({"allOf", "if", "then", "else", "not", "dependentSchemas"})
_PROPERTY_KEYWORDS = ("additionalProperties", "unevaluatedProperties")


def prepare_json_schema(schema_text: str, strict: bool, bound_digits: bool) -> str:
    """The schema text a backend compiles: with `strict`, every object schema that names its properties
    (`properties` or `patternProperties`) and says nothing of others gets `additionalProperties: false`, and a
    tuple (`prefixItems`) that says nothing of further items gets `items: false`; with `bound_digits`, ranged
    numbers get `multipleOf: 1e-6` (bounded_number_digits). Text that is not JSON is returned as it is (the
    compiler reports it)."""
    if not strict and not bound_digits:
        return schema_text
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text
    if strict:
        schema = _strict(schema, combined=False)
    if bound_digits:
        schema = _bound_digits(schema)
    return json.dumps(schema)


def bounded_number_digits(schema_text: str) -> str:
    """The JSON schema with `multipleOf: 1e-6` on every number that has a range and no multipleOf (and bounds that
    are such multiples themselves), for llguidance: its ranged numbers otherwise allow any number of digits, and a
    model can write "1.0000..." under `maximum: 1` until max_tokens. xgrammar bounds them to the same 6 digits."""
    return prepare_json_schema(schema_text, strict=False, bound_digits=True)


def _children(node: dict[str, Any], fn: Any) -> dict[str, Any]:
    """A copy of a schema node with `fn(key, subschema)` applied to every subschema under it (data kept as is)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _MAP_KEYWORDS and isinstance(value, dict):
            out[key] = {name: fn(key, sub) for name, sub in value.items()}
        elif isinstance(value, list):
            out[key] = [fn(key, sub) for sub in value]
        else:
            out[key] = fn(key, value)
    return out


def _strict(node: Any, combined: bool) -> Any:
    """`combined`: the node is a branch of allOf/anyOf/... and its parent's properties apply to the same object."""
    if not isinstance(node, dict):
        return node
    combines = any(k in node for k in _COMBINED_KEYWORDS)
    names_properties = "properties" in node or "patternProperties" in node
    out = _children(node, lambda key, sub: _strict(sub, key in _ALWAYS_COMBINED
                                                   or (names_properties and key in _COMBINED_KEYWORDS)))
    if names_properties and not combined and not combines and not any(k in node for k in _PROPERTY_KEYWORDS):
        out["additionalProperties"] = False
    if "prefixItems" in node and not combined and not combines and "items" not in node \
            and "unevaluatedItems" not in node:
        out["items"] = False
    return out


def _bound_digits(node: Any) -> Any:
    if isinstance(node, list):
        return [_bound_digits(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = _children(node, lambda key, sub: _bound_digits(sub))
    types = node.get("type")
    is_number = types == "number" or (isinstance(types, list) and "number" in types)
    bounds = [node[k] for k in _BOUNDS if isinstance(node.get(k), (int, float)) and not isinstance(node[k], bool)]
    scale = 10 ** NUMBER_FRACTION_DIGITS
    if is_number and bounds and "multipleOf" not in node and all(abs(b * scale - round(b * scale)) < 1e-6
                                                                 for b in bounds):
        out["multipleOf"] = 10.0 ** -NUMBER_FRACTION_DIGITS
    return out
