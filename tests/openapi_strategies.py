"""Hypothesis strategies for request bodies, built from the frontend's own OpenAPI
description (`GET /openapi.json`), valid and not.

Why not hypothesis-jsonschema or schemathesis: the former does not run on the pinned
hypothesis (it reaches into internals that have changed), and the latter brings a
synchronous requests-based runner, a GraphQL stack and a Rust validator (ten packages) to
check what these few strategies and the properties in tests/fuzz_checks.py check, in
process. The subset of JSON Schema here is what pydantic emits for the request models.

`valid(schema)` follows the schema (types, bounds, enums, required, unions), leaving
out optional fields at random; `hostile(schema)` is a valid body with some fields replaced
by any JSON value (wrong types, huge numbers, odd unicode, deep nesting, NaN and the
infinities, dicts keyed by unicode digits or integers of thousands of digits, giant strings
in string fields) or unknown fields added.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

Schema = dict[str, Any]

# Text a tokenizer, a template or a JSON encoder may trip on: controls, combining marks,
# astral characters, right-to-left, lone surrogates (JSON allows them as escapes).
ODD_TEXT = st.sampled_from(
    ["", " ", "\x00", "\u202e", "e\u0301", "🙂" * 3, "\ud800", "\udfff", "\uffff", "日本語"]
)
TEXT = st.one_of(st.text(max_size=40), ODD_TEXT, st.text(st.characters(), max_size=8))
HUGE = st.sampled_from([2**31, 2**32, 2**63, -(2**63) - 1, 10**30, -(10**30), 1e308, -1e308])
NUMBER = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False), HUGE)
# Digits int() or str.isdigit() disagree on (superscripts, circled, Arabic-Indic, full-width),
# and integers past Python's 4,300-digit int/str limit, as text: dict keys and values.
UNICODE_DIGITS = st.sampled_from(["²", "⁵", "①", "٣", "１２", "𝟘", "߁"])
HUGE_DIGITS = st.sampled_from(["9" * 4301, "1" * 10_000, "-" + "7" * 5000, "0" * 4400 + "1"])
DIGIT_KEYS = st.one_of(UNICODE_DIGITS, HUGE_DIGITS, st.integers(-5, 10**12).map(str))
# A giant string: every string field gets one now and then (bodies stay under the limit).
GIANT = st.sampled_from([10_000, 200_000]).flatmap(
    lambda n: st.sampled_from(["a", "🙂", "\u0301", "9", " "]).map(lambda c: c * n)
)
# NaN and the infinities as JSON text: Python's json.dumps writes NaN / Infinity.
NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value (no NaN: the raw-body strategies send NaN and Infinity as text)."""
    leaf = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )


def nested(depth: int) -> Any:
    """A list inside a dict inside a list ... `depth` deep."""
    value: Any = 0
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


# (deeper ones go as raw bytes: Python's own json.dumps stops near 1,000 levels)
DEEP = st.sampled_from([10, 100, 900]).map(nested)


class OpenAPI:
    """The request schemas of one OpenAPI document, and strategies over them."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.schemas: dict[str, Schema] = doc["components"]["schemas"]
        self._built: dict[tuple[int, int], st.SearchStrategy[Any]] = {}

    def body_schema(self, path: str) -> Schema:
        content = self.doc["paths"][path]["post"]["requestBody"]["content"]
        return content["application/json"]["schema"]

    def _resolve(self, schema: Schema) -> Schema:
        while "$ref" in schema:
            schema = self.schemas[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def valid(self, schema: Schema, depth: int = 0) -> st.SearchStrategy[Any]:
        key = (id(schema), depth)  # built once per (sub)schema: building is the slow part
        if key not in self._built:
            self._built[key] = self._valid(schema, depth)
        return self._built[key]

    def _valid(self, schema: Schema, depth: int) -> st.SearchStrategy[Any]:
        s = self._resolve(schema)
        if "anyOf" in s:
            return st.one_of([self.valid(b, depth) for b in s["anyOf"]])
        if "enum" in s:
            return st.sampled_from(s["enum"])
        if "const" in s:
            return st.just(s["const"])
        kind = s.get("type")
        if isinstance(kind, list):
            return st.one_of([self.valid(s | {"type": k}, depth) for k in kind])
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            return _integers(s)
        if kind == "number":
            return _numbers(s)
        if kind == "string":
            return _strings(s)
        if kind == "array":
            items = self.valid(s.get("items", {}), depth + 1) if depth < 4 else st.just(0)
            return st.lists(items, min_size=s.get("minItems", 0), max_size=4)
        if kind == "object" and "properties" in s:
            return self._object(s, depth)
        return json_values(6)  # an untyped value, or a free-form object

    def _object(self, s: Schema, depth: int) -> st.SearchStrategy[dict[str, Any]]:
        props, required = s["properties"], set(s.get("required", ()))
        fields = {k: self.valid(v, depth + 1) for k, v in props.items()}

        @st.composite
        def build(draw) -> dict[str, Any]:
            out = {}
            for name, strategy in fields.items():
                if name in required or draw(st.integers(0, 3)) == 0:  # optional: 1 in 4
                    out[name] = draw(strategy)
            return out

        return build()

    def fields(self, schema: Schema) -> dict[str, st.SearchStrategy[Any]]:
        """Each property's strategy, by name (of every branch of a union)."""
        s = self._resolve(schema)
        out: dict[str, st.SearchStrategy[Any]] = {}
        for branch in [self._resolve(b) for b in s.get("anyOf", [])] + [s]:
            props = branch.get("properties", {})
            out |= {name: self.valid(sub, 1) for name, sub in props.items()}
        return out

    def hostile(self, schema: Schema) -> st.SearchStrategy[Any]:
        """A valid body with fields replaced by any value, deleted, or unknown ones added."""
        s = self._resolve(schema)
        names = sorted(s.get("properties", {}))

        @st.composite
        def mutate(draw) -> Any:
            body = draw(self.valid(schema))
            if not isinstance(body, dict) or not names:
                return body
            for _ in range(draw(st.integers(1, 3))):
                name = draw(st.sampled_from(names))
                match draw(st.integers(0, 7)):
                    case 0:
                        body.pop(name, None)
                    case 1:
                        body[name] = draw(DEEP)
                    case 2:
                        body[draw(TEXT)] = draw(json_values())
                    case 3:  # a dict keyed and valued by odd digits (logit_bias, metadata)
                        body[name] = draw(
                            st.dictionaries(
                                DIGIT_KEYS,
                                st.one_of(NUMBER, NON_FINITE, DIGIT_KEYS),
                                min_size=1,
                                max_size=3,
                            )
                        )
                    case 4:
                        body[name] = draw(st.one_of(NON_FINITE, HUGE_DIGITS, UNICODE_DIGITS))
                    case _:
                        body[name] = draw(st.one_of(json_values(), HUGE))
            if draw(st.integers(0, 5)) == 0:  # a giant string in one string field
                strings = [k for k, v in body.items() if isinstance(v, str)]
                if strings:
                    body[draw(st.sampled_from(sorted(strings)))] = draw(GIANT)
            return body

        return mutate()


def _integers(s: Schema) -> st.SearchStrategy[int]:
    lo, hi = s.get("minimum"), s.get("maximum")
    if "exclusiveMinimum" in s:
        lo = int(s["exclusiveMinimum"]) + 1
    if "exclusiveMaximum" in s:
        hi = int(s["exclusiveMaximum"]) - 1
    bounded = st.integers(lo, hi)
    if lo is None and hi is None:  # mostly small, sometimes past every limit
        return st.one_of(st.integers(-3, 40), bounded, HUGE.filter(lambda v: isinstance(v, int)))
    return bounded


def _numbers(s: Schema) -> st.SearchStrategy[float]:
    lo = s.get("minimum", s.get("exclusiveMinimum"))
    hi = s.get("maximum", s.get("exclusiveMaximum"))
    floats = st.floats(
        lo,
        hi,
        allow_nan=False,
        allow_infinity=False,
        exclude_min="exclusiveMinimum" in s,
        exclude_max="exclusiveMaximum" in s,
    )
    if lo is None and hi is None:
        return st.one_of(st.floats(-3, 3), floats)
    return floats


def _strings(s: Schema) -> st.SearchStrategy[str]:
    if "pattern" in s:
        return st.from_regex(s["pattern"], fullmatch=True)
    lo, hi = s.get("minLength", 0), s.get("maxLength")
    return st.one_of(st.text(min_size=lo, max_size=min(hi or 40, 40)), ODD_TEXT).filter(
        lambda t: len(t) >= lo and (hi is None or len(t) <= hi)
    )
