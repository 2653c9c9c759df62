"""Twenty JSON schemas for the structured-output tests: nested objects, arrays, enums,
required fields, numbers with bounds. Strings and arrays are bounded so that even a
random-weight model reaches the end of the grammar within a short ``max_tokens``."""

from __future__ import annotations

from typing import Any

S = {"type": "string", "maxLength": 6}
INT = {"type": "integer", "minimum": 0, "maximum": 999}


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS: list[dict[str, Any]] = [
    obj({"name": S}),
    obj({"age": INT}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}}),
    obj({"temp": {"type": "integer", "minimum": -40, "maximum": 50}, "unit": {"enum": ["C", "F"]}}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    obj({"point": obj({"x": INT, "y": INT})}),
    obj({"user": obj({"name": S, "address": obj({"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
    obj({"items": {"type": "array", "items": obj({"id": INT, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                   "minItems": 1, "maxItems": 2}}),
    obj({"a": S, "b": INT, "c": {"type": "boolean"}}, required=["a"]),
    obj({"status": {"const": "done"}, "code": INT}),
    obj({"value": {"anyOf": [INT, {"type": "boolean"}]}}),
    obj({"nums": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4}}),
    obj({"level": {"enum": [1, 2, 3]}, "name": {"type": ["string", "null"], "maxLength": 4}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 2},
                    "maxItems": 2}}),
    obj({"id": {"type": "string", "pattern": "^[a-f0-9]{8}$"}, "priority": {"enum": ["low", "high"]}}),
    obj({"price": {"type": "number", "minimum": 0, "maximum": 100, "exclusiveMaximum": 100}, "currency": {"enum": ["USD", "EUR"]}}),
    obj({"config": obj({"debug": {"type": "boolean"}, "retries": {"type": "integer", "minimum": 0, "maximum": 5},
                        "mode": {"enum": ["fast", "safe"]}}), "version": {"const": 2}}),
    {"type": "array", "items": obj({"k": {"enum": ["x", "y"]}, "v": INT}), "minItems": 1, "maxItems": 2},
]
