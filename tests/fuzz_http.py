"""Hostile HTTP requests for the frontend, and what every answer must be: the strategy and
the properties shared by the in-process fuzz test and the one against a launched cluster.

Properties of each answer: no 5xx (the client's input is never the server's fault; a 504
for a request whose own `timeout` passed is its answer); a 4xx
carries an OpenAI error body ({"error": {message, type, param, code}}); a 200 is JSON, or
server-sent events of JSON chunks ending in [DONE], with no server_error inside.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st

from tests.openapi_strategies import DEEP, DIGIT_KEYS, HUGE, NON_FINITE, OpenAPI

POSTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
GETS = ("/v1/models", "/health", "/openapi.json", "/metrics")
CONTENT_TYPES = (
    "application/json",
    "application/json; charset=latin-1",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "",
)
RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"{",
            b"null",
            b"[]",
            b'"x"',
            b"1e999999",
            b'{"model": NaN, "prompt": Infinity, "max_tokens": -Infinity}',
            b'{"temperature": NaN, "top_p": NaN, "model": "m", "prompt": "p"}',
            b"[" * 100_000 + b"]" * 100_000,
            b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
            b'{"prompt": "\\ud800", "model": "m"}',
            b"\xef\xbb\xbf{}",  # a UTF-8 byte order mark
            b"\x00" * 32,
        ]
    ),
)


USER = [{"role": "user", "content": "hi"}]
BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 8},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 8},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}


@dataclass
class HttpCase:
    method: str
    path: str
    content: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:  # hypothesis prints it on failure: keep it readable
        return f"HttpCase({self.method} {self.path} {self.headers} {self.content[:300]!r})"


def _encode(body: Any, ascii_only: bool) -> bytes:
    # Lone surrogates: escaped (valid JSON, odd text) or as raw bytes (invalid UTF-8).
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def http_cases(api: OpenAPI, served_model: str) -> st.SearchStrategy[HttpCase]:
    """Requests to every endpoint: schema-valid bodies, hostile ones, raw bytes, wrong
    content types, methods and paths."""

    @st.composite
    def case(draw) -> HttpCase:
        kind = draw(
            st.sampled_from(["plausible"] * 3 + ["valid", "hostile", "hostile", "raw", "get"])
        )
        if kind == "get":
            path = draw(st.sampled_from(GETS + ("/v1/nothing", "/v1/completions")))
            return HttpCase("GET", path, b"")
        path = draw(st.sampled_from(POSTS))
        ctype = draw(st.sampled_from(CONTENT_TYPES[:1] * 4 + CONTENT_TYPES))
        headers = {"content-type": ctype} if ctype else {}
        if kind == "raw":
            return HttpCase("POST", path, draw(RAW_BODIES), headers)
        schema = api.body_schema(path)
        if kind == "plausible":  # a body that is served, plus a few schema-valid fields
            fields = api.fields(schema)
            names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True))
            body = BASES[path] | {name: draw(fields[name]) for name in names}
            body["model"] = served_model
            if "logit_bias" in fields and draw(st.integers(0, 4)) == 0:  # odd token-id keys
                values = st.one_of(st.floats(-100, 100), NON_FINITE, HUGE)
                body["logit_bias"] = draw(st.dictionaries(DIGIT_KEYS, values, max_size=3))
        else:
            body = draw(api.valid(schema) if kind == "valid" else api.hostile(schema))
        if isinstance(body, dict) and "model" in body and draw(st.integers(0, 3)):
            body["model"] = served_model  # mostly the served model: past the 404
        if draw(st.integers(0, 9)) == 0:
            body = {"wrapped": body, "deep": draw(DEEP)}
        return HttpCase("POST", path, _encode(body, draw(st.booleans())), headers)

    return case()


def check_answer(case: HttpCase, resp: httpx.Response) -> None:
    """The properties of one answer (AssertionError naming the case otherwise)."""
    status = resp.status_code
    if status == 504 and b'"timeout"' in case.content:
        # The client's own deadline passed (it asked for one): its answer, not a failure.
        assert resp.json()["error"]["code"] == "request_timeout", (case, resp.text[:300])
        return
    assert status < 500, f"{case!r} -> {status}: {resp.text[:500]}"
    if status >= 400:
        body = resp.json()
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"], (case, body)
        assert isinstance(err["type"], str), (case, body)
        assert set(err) == {"message", "type", "param", "code"}, (case, body)
        assert err["type"] != "server_error", (case, body)
        return
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [
            line.removeprefix("data: ")
            for line in resp.text.split("\n\n")
            if line.startswith("data: ")
        ]
        assert events and events[-1] == "[DONE]", (case, resp.text[-300:])
        for event in events[:-1]:
            chunk = json.loads(event)
            assert "error" not in chunk or chunk["error"]["type"] != "server_error", (case, chunk)
        return
    if case.path != "/metrics":
        resp.json()  # a 200 is JSON


def send(client: httpx.Client, case: HttpCase) -> httpx.Response:
    return client.request(case.method, case.path, content=case.content, headers=case.headers)
