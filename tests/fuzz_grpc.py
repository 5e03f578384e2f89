"""Hostile gRPC requests: random and invalid protobuf fields for `Frontend.Generate` and
`Worker.Generate`, and bytes that are no message at all; and what every answer must be.
Shared by the in-process fuzz test and the one against a launched cluster.

Property of each call: it streams to the end, or fails with a status that blames the
request (INVALID_ARGUMENT, ...); never INTERNAL or UNKNOWN (a server bug), nor UNAVAILABLE
(a process that went away).
"""

from __future__ import annotations

import math

import grpc
from hypothesis import strategies as st

from rtp_serve.services.common.pb import common_pb2, frontend_pb2, worker_pb2

SERVER_FAULTS = frozenset(
    {
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
U32 = st.one_of(st.integers(0, 60), st.integers(0, 2**32 - 1), st.sampled_from([2**32 - 1]))
I32 = st.one_of(st.integers(-3, 40), st.integers(-(2**31), 2**31 - 1))
FLOAT = st.one_of(
    st.floats(-3, 3, width=32),
    st.floats(width=32),  # NaN and the infinities too: proto floats carry them
    st.sampled_from([0.0, -0.0, 1.0, math.inf, -math.inf, math.nan, 3.4e38]),
)
TEXT = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=30),
    st.sampled_from(["", "hi", "\x00", "🙂" * 5, "e\u0301", "\u202e"]),
)
TOKENS = st.one_of(
    st.lists(st.integers(0, 300), max_size=20),
    st.lists(U32, max_size=20),
    st.integers(0, 20_000).map(lambda n: [1] * n),  # up to past every context
)


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        max_tokens=draw(st.one_of(st.integers(0, 12), U32)),
        temperature=draw(FLOAT),
        top_k=draw(I32),
        top_p=draw(FLOAT),
        stop_token_ids=draw(st.lists(U32, max_size=4)),
        ignore_eos=draw(st.booleans()),
        min_tokens=draw(st.one_of(st.integers(0, 4), U32)),
        presence_penalty=draw(FLOAT),
        frequency_penalty=draw(FLOAT),
        repetition_penalty=draw(FLOAT),
        logit_bias=draw(st.dictionaries(U32, FLOAT, max_size=3)),
        speculative_advice=draw(st.lists(U32, max_size=4)),
    )
    if draw(st.booleans()):
        p.seed = draw(st.integers(-(2**63), 2**63 - 1))
    if draw(st.booleans()):
        p.logprobs = draw(st.one_of(st.integers(0, 25), U32))
    if draw(st.booleans()):
        p.num_speculative_tokens = draw(st.one_of(st.integers(0, 20), U32))
    return p


@st.composite
def structured(draw) -> worker_pb2.StructuredOutput | None:
    kind = draw(st.sampled_from(["none", "none", "json_schema", "regex", "choice", "grammar"]))
    if kind == "none":
        return None
    out = worker_pb2.StructuredOutput(resume_tokens=draw(st.one_of(st.just(0), U32)))
    junk = st.one_of(TEXT, st.sampled_from(['{"type": "object"}', "[a-z]+", "{", "start: x"]))
    match kind:
        case "json_schema":
            out.json_schema = draw(junk)
        case "regex":
            out.regex = draw(junk)
        case "grammar":
            out.grammar = draw(junk)
        case _:
            out.choice.choices.extend(draw(st.lists(TEXT, max_size=3)))
    return out


@st.composite
def frontend_requests(draw) -> frontend_pb2.FrontendGenerateRequest:
    req = frontend_pb2.FrontendGenerateRequest(
        params=draw(sampling_params()),
        stop=draw(st.one_of(st.lists(TEXT, max_size=4), st.lists(TEXT, max_size=40))),
        session_id=draw(TEXT),
        priority=draw(I32),
    )
    match draw(st.sampled_from(["text", "ids", "none"])):
        case "text":
            req.text = draw(st.one_of(TEXT, st.integers(0, 200_000).map(lambda n: "ab " * n)))
        case "ids":
            req.token_ids.ids.extend(draw(TOKENS))
    if (spec := draw(structured())) is not None:
        req.structured.CopyFrom(spec)
    return req


@st.composite
def worker_requests(draw) -> worker_pb2.GenerateRequest:
    req = worker_pb2.GenerateRequest(
        request_id=draw(TEXT),
        prompt_token_ids=draw(TOKENS),
        params=draw(sampling_params()),
        priority=draw(I32),
        # A fused worker given an address tries it as its prefill peer: junk, or nobody.
        prefill_address=draw(st.sampled_from(["", "", "", "127.0.0.1:1", "::::", "\x00"])),
        block_hashes=draw(st.lists(st.binary(max_size=40), max_size=3)),
    )
    if (spec := draw(structured())) is not None:
        req.structured.CopyFrom(spec)
    return req


GARBAGE = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"\xff" * 10, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\x80" * 11]),
)


def check_status(what: object, exc: grpc.RpcError | None) -> None:
    if exc is not None:
        assert exc.code() not in SERVER_FAULTS, f"{what!r} -> {exc.code()}: {exc.details()}"


def call_stream(channel: grpc.Channel, method: str, payload: bytes) -> grpc.RpcError | None:
    """Call a server-streaming `method` with raw bytes as its request; the error, if any."""
    call = channel.unary_stream(method)  # no serializers: bytes in, bytes out
    try:
        for _ in call(payload, timeout=60):
            pass
    except grpc.RpcError as exc:
        return exc
    return None
