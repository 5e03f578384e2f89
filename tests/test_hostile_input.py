"""What fuzzing found, one regression each, and the request limits with their errors (a
400 or 413 naming the field), over scripted workers."""

from __future__ import annotations

import json

import httpx
import pytest

from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.services.frontend.client_streams import ClientStreams, grpc_peer_host
from rtp_serve.services.frontend.errors import FrontendError
from rtp_serve.services.frontend.limits import Limits
from tests.frontend_fakes import FakeWorker
from tests.fuzz_harness import served_frontend

MODEL = "tiny-llama"
TEXT = "Hello, limits 🙂 — done."
LIMITS = Limits(
    max_body_bytes=1 << 20,
    max_prompt_tokens=50,
    max_tokens=40,
    max_n=2,
    max_stop=3,
    max_stop_chars=8,
    max_logprobs=5,
    max_streams_per_client=2,
)


@pytest.fixture(scope="module")
def tiny(model_dir):
    return model_dir("tiny-llama")


@pytest.fixture(scope="module")
def script(tiny) -> list[int]:
    return Tokenizer(tiny).encode(TEXT)


@pytest.fixture(scope="module")
def client(tiny, script):
    with (
        served_frontend(tiny, FakeWorker(script, eos=0), LIMITS) as served,
        httpx.Client(base_url=served.url, timeout=30) as c,
    ):
        yield c


def error(reply: httpx.Response, status: int, param: str | None) -> str:
    assert reply.status_code == status, reply.text[:300]
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err["message"]


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4} | kw


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | kw


# -- found by fuzzing ----------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_lone_surrogate_is_400_not_a_tokenizer_crash(client, path) -> None:
    raw = b'{"model": "tiny-llama", "prompt": "a\\udfffb"}'
    assert "surrogate" in error(client.post(path, content=raw), 400, None)
    pair = b'{"model": "tiny-llama", "prompt": "\\ud83d\\ude42"}'
    assert client.post(path, content=pair).status_code == 200  # an escaped pair is text


@pytest.mark.parametrize(
    "raw", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000]
)
def test_json_nested_past_the_parser_is_400(client, raw) -> None:
    assert "nested too deeply" in error(client.post("/v1/completions", content=raw), 400, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", 2**31), ("priority", 2**31), ("priority", -(2**31) - 1), ("timeout", 7.4e9)],
)
def test_numbers_past_the_wire_types_name_the_field(client, field, value) -> None:
    """Once a 500 (protobuf's int32 overflowed) or a 504 at once (gRPC took a deadline of
    7.4e9 s as passed)."""
    error(client.post("/v1/completions", json=completion(**{field: value})), 400, field)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny-llama", "prompt": "hi", "temperature": NaN}',
        b'{"model": "tiny-llama", "prompt": "hi", "temperature": Infinity}',
        b'{"model": "tiny-llama", "prompt": "hi", "temperature": 1e999}',
    ],
)
def test_non_finite_numbers_are_not_json(client, raw) -> None:
    assert "not valid JSON" in error(client.post("/v1/completions", content=raw), 400, None)


def test_a_malformed_header_is_400_and_the_server_goes_on(client) -> None:
    # aiohttp's HTTP parser answers this itself (text, before the app sees a request).
    reply = client.post("/v1/completions", content=b"{}", headers={"content-type": "\x7f"})
    assert reply.status_code == 400
    assert client.post("/v1/completions", json=completion()).status_code == 200


# -- limits ----------------------------------------------------------------------------------
def test_body_over_the_limit_is_413(client) -> None:
    reply = client.post("/v1/completions", json=completion(prompt="x" * (1 << 20)))
    assert "1048576 bytes" in error(reply, 413, None)
    assert reply.json()["error"]["code"] == "request_too_large"


def test_prompt_tokens_over_the_limit(client, tiny) -> None:
    ids = Tokenizer(tiny).encode("word " * 60)
    assert len(ids) > 50
    assert "limit is 50" in error(
        client.post("/v1/completions", json=completion(prompt=ids)), 400, "prompt"
    )
    text = "word " * 60
    error(client.post("/v1/completions", json=completion(prompt=text)), 400, "prompt")
    long_chat = chat(messages=[{"role": "user", "content": text}])
    error(client.post("/v1/chat/completions", json=long_chat), 400, "messages")


def test_a_text_that_cannot_fit_is_refused_before_tokenizing(client) -> None:
    # Far more characters than 50 tokens can cover, in a body under the size limit.
    reply = client.post("/tokenize", json={"prompt": "y" * 500_000})
    assert "characters" in error(reply, 400, "prompt")


def test_max_tokens_over_the_limit(client) -> None:
    assert "limit is 40" in error(
        client.post("/v1/completions", json=completion(max_tokens=41)), 400, "max_tokens"
    )
    reply = client.post("/v1/chat/completions", json=chat())  # no max_tokens: capped at 40
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        (completion(n=3), "n", "between 1 and 2"),
        (completion(stop=["a", "b", "c", "d"]), "stop", "at most 3 stop strings"),
        (completion(stop="123456789"), "stop", "at most 8"),
        (completion(logprobs=6), "logprobs", "[0, 5]"),
    ],
)
def test_completion_limits_name_the_field(client, body, param, text) -> None:
    assert text in error(client.post("/v1/completions", json=body), 400, param)


def test_chat_top_logprobs_limit_names_top_logprobs(client) -> None:
    reply = client.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=6))
    assert "[0, 5]" in error(reply, 400, "top_logprobs")


def test_streams_per_client() -> None:
    streams = ClientStreams(2)
    with streams.admit("a"), streams.admit("a"):
        with pytest.raises(FrontendError) as exc, streams.admit("a"):
            pass
        assert exc.value.kind.http_status == 429 and exc.value.code == "rate_limit_exceeded"
        with streams.admit("b"):  # another client is not held up
            assert streams.open("b") == 1
    assert streams.open("a") == 0 and not streams._open  # nothing kept per client
    with ClientStreams(0).admit("a"):  # 0: no bound
        pass
    assert grpc_peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert grpc_peer_host("ipv6:[::1]:5000") == "::1"
    assert grpc_peer_host("unix:/tmp/s") == "unix:/tmp/s"


def test_a_client_past_its_streams_gets_429(tiny, script) -> None:
    """Two streams held open (a slow worker) and a third refused; once they end, served."""
    import asyncio

    slow = FakeWorker(script, delay=0.3)
    with served_frontend(tiny, slow, LIMITS) as served:

        async def go():
            async with httpx.AsyncClient(base_url=served.url, timeout=30) as c:
                body = completion(max_tokens=5, stream=True)
                held = [c.stream("POST", "/v1/completions", json=body) for _ in range(2)]
                replies = [await h.__aenter__() for h in held]
                assert all(r.status_code == 200 for r in replies)
                third = await c.post("/v1/completions", json=completion())
                for h in held:
                    await h.__aexit__(None, None, None)
                await asyncio.sleep(0.2)  # the server notices the streams closed
                after = await c.post("/v1/completions", json=completion())
                return third, after

        third, after = asyncio.run(go())
    assert third.status_code == 429 and third.headers["Retry-After"] == "1"
    assert "limit per client" in third.json()["error"]["message"]
    assert after.status_code == 200, after.text


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        Limits(max_n=0)
    with pytest.raises(ValueError):
        Limits(body_timeout_s=0)
    assert json.dumps(Limits().prompt_limit(2048)) == "2047"
    assert Limits(max_prompt_tokens=10).prompt_limit(2048) == 10
