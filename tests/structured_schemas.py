"""Twenty JSON schemas for the structured-output tests and benchmark: nested objects, arrays,
enums, required fields, numbers with bounds, strings with patterns and lengths.

Each is paired with a short question that a small chat model can start answering in a few
tokens; the tests cut outputs at a small max_tokens, so the schemas are kept short (a
truncated output is `finish_reason: length` and is not expected to parse).
"""

from __future__ import annotations

from typing import Any

_STR = {"type": "string", "maxLength": 12}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "person",
        {
            "type": "object",
            "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "color",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
    ),
    ("bool", {"type": "boolean"}),
    ("int-bounds", {"type": "integer", "minimum": 10, "maximum": 99}),
    # multipleOf bounds the digits too: unbounded, a small model may write 1.1000000...
    ("number-bounds", {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25}),
    ("zip", {"type": "string", "pattern": "^[0-9]{5}$"}),
    ("enum-string", {"type": "string", "enum": ["yes", "no", "maybe"]}),
    (
        "int-array",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    (
        "point",
        {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -9, "maximum": 9},
                "y": {"type": "integer", "minimum": -9, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    ),
    (
        "nested",
        {
            "type": "object",
            "properties": {
                "city": {
                    "type": "object",
                    "properties": {"name": _STR, "big": {"type": "boolean"}},
                    "required": ["name", "big"],
                    "additionalProperties": False,
                }
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    ),
    ("const", {"const": "ok"}),
    (
        "null-or-int",
        {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 999}]},
    ),
    (
        "tags",
        {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "minItems": 1,
            "maxItems": 2,
        },
    ),
    (
        "date",
        {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
    ),
    (
        "rating",
        {
            "type": "object",
            "properties": {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "mood": {"enum": ["happy", "sad"]},
            },
            "required": ["stars", "mood"],
            "additionalProperties": False,
        },
    ),
    ("short-string", {"type": "string", "minLength": 2, "maxLength": 8}),
    (
        "empty-object-ok",
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    ),
    (
        "tuple",
        {
            "type": "array",
            "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "boolean"}],
            "items": False,
            "minItems": 2,
        },
    ),
    ("percent", {"type": "number", "exclusiveMinimum": 0, "maximum": 100, "multipleOf": 0.5}),
    (
        "item",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            },
            "required": ["id", "qty", "tags"],
            "additionalProperties": False,
        },
    ),
]

QUESTION = "Answer in JSON only."
