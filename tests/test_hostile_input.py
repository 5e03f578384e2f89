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
def served(tiny, script):
    with served_frontend(tiny, FakeWorker(script, eos=0), LIMITS) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=30) as c:
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


# -- issue 33: bad input ---------------------------------------------------------------------
@pytest.mark.parametrize("key", ["²", "⁵", "①", "٣", "1" * 5000, "-1", " 1", "1.0", "", "0x1"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logit_bias_keys_must_be_ascii_token_ids(client, path, key) -> None:
    """Once a 500: "²".isdigit() is true and int() refuses it; past 4,300 digits int()
    refuses any string."""
    body = (completion if path == "/v1/completions" else chat)(logit_bias={key: 1.0})
    assert "token ids" in error(client.post(path, json=body), 400, "logit_bias")


def test_logit_bias_keys_past_the_vocabulary_name_logit_bias(client) -> None:
    for key in ("8192", "4294967296", "9" * 10):
        reply = client.post("/v1/completions", json=completion(logit_bias={key: 1.0}))
        assert "out of range" in error(reply, 400, "logit_bias")
    ok = client.post("/v1/completions", json=completion(logit_bias={"8191": 1.0, "007": -1.0}))
    assert ok.status_code == 200, ok.text


def test_speculative_advice_longer_than_the_context_is_refused_before_tokenizing(client) -> None:
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]
    reply = client.post("/v1/completions", json=completion(speculative_advice="z" * (context + 1)))
    assert f"at most {context}" in error(reply, 400, "speculative_advice")
    fits = client.post("/v1/completions", json=completion(speculative_advice="z" * context))
    assert fits.status_code == 200, fits.text


def test_speculative_advice_token_ids_over_grpc_are_bounded_by_the_context(served) -> None:
    import grpc

    from rtp_serve.services.common.pb import common_pb2, frontend_pb2, frontend_pb2_grpc

    ids = frontend_pb2.TokenIds(ids=[1, 2, 3])
    advice = common_pb2.SamplingParams(max_tokens=2, speculative_advice=[1] * 2049)
    request = frontend_pb2.FrontendGenerateRequest(token_ids=ids, params=advice)
    with grpc.insecure_channel(served.grpc_address) as ch, pytest.raises(grpc.RpcError) as exc:
        list(frontend_pb2_grpc.FrontendStub(ch).Generate(request, timeout=30))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculative_advice" in exc.value.details()


def test_token_id_prompts_are_refused_by_length_before_their_elements(client) -> None:
    """A prompt longer than the context is refused by its length, not scanned first."""
    reply = client.post("/v1/completions", json=completion(prompt=[10**6] * 2049))
    assert "maximum context length" in error(reply, 400, "prompt")


# -- issue 33: least privilege ---------------------------------------------------------------
def test_a_priority_more_urgent_than_the_default_is_403(client) -> None:
    """Without API keys every client gets --priority-floor (0): lower runs first, so a
    negative priority would jump the queue."""
    reply = client.post("/v1/completions", json=completion(priority=-1))
    assert "lower runs first" in error(reply, 403, "priority")
    assert reply.json()["error"]["type"] == "permission_error"
    for ok in (0, 7):
        reply = client.post("/v1/completions", json=completion(priority=ok))
        assert reply.status_code == 200, reply.text


@pytest.fixture(scope="module")
def keyed(tiny, script):
    from rtp_serve.services.frontend.auth import ApiKeys, parse_key

    keys = ApiKeys.of([parse_key("ops priority=-5"), parse_key("plain")], metrics_key="m")
    with served_frontend(tiny, FakeWorker(script, eos=0), LIMITS, keys) as served:
        yield served


def test_an_api_key_carries_its_priority_allowance(keyed) -> None:
    import grpc

    from rtp_serve.services.common.pb import common_pb2, frontend_pb2, frontend_pb2_grpc

    with httpx.Client(base_url=keyed.url, timeout=30) as c:

        def post(key: str, priority: int) -> httpx.Response:
            auth = {"Authorization": f"Bearer {key}"}
            return c.post("/v1/completions", json=completion(priority=priority), headers=auth)

        assert post("ops", -5).status_code == 200
        error(post("ops", -6), 403, "priority")
        error(post("plain", -1), 403, "priority")
        assert post("plain", 0).status_code == 200
        # The metrics key guards /metrics only: it is no API key.
        error(post("m", 0), 401, None)
    request = frontend_pb2.FrontendGenerateRequest(
        text="hi", params=common_pb2.SamplingParams(max_tokens=2), priority=-6
    )
    with grpc.insecure_channel(keyed.grpc_address) as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(request, metadata=[("authorization", "Bearer ops")], timeout=30))
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        request.priority = -5
        assert list(stub.Generate(request, metadata=[("authorization", "Bearer ops")], timeout=30))


def test_a_metrics_key_alone_leaves_the_api_open(tiny, script) -> None:
    """Once every API request was a 401 while the log said anyone may use the model."""
    from rtp_serve.services.frontend.auth import ApiKeys

    keys = ApiKeys.of([], metrics_key="m")
    with (
        served_frontend(tiny, FakeWorker(script, eos=0), LIMITS, keys) as served,
        httpx.Client(base_url=served.url, timeout=30) as c,
    ):
        assert c.post("/v1/completions", json=completion()).status_code == 200
        error(c.get("/metrics"), 401, None)
        assert c.get("/metrics", headers={"Authorization": "Bearer m"}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_lora_admin_endpoints_are_refused_without_an_admin_key(client, keyed, path) -> None:
    body = {"lora_name": "a", "lora_path": "/etc"}
    assert "--admin-key" in error(client.post(path, json=body), 403, None)
    with httpx.Client(base_url=keyed.url, timeout=30) as c:  # an API key is no admin key
        reply = c.post(path, json=body, headers={"Authorization": "Bearer ops"})
        error(reply, 403, None)


def test_lora_loading_needs_a_root_and_stays_inside_it(tiny, script, tmp_path) -> None:
    import asyncio

    from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
    from rtp_serve.services.frontend.auth import ApiKeys
    from tests.frontend_fakes import frontend

    root, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    keys = ApiKeys.of(["user"], admin_key="adm")
    admin = {"Authorization": "Bearer adm"}
    workers = {"w1": (ns_pb2.ROLE_FUSED, FakeWorker(script, eos=0))}

    async def go(lora_root) -> list[tuple[int, dict]]:
        async with frontend(tiny, workers, keys=keys, lora_root=lora_root) as h:
            out = []
            for path in ("real", str(outside), "../elsewhere", "real/../../elsewhere", "link"):
                body = {"lora_name": "a", "lora_path": path}
                r = await h.client.post("/v1/load_lora_adapter", json=body, headers=admin)
                out.append((r.status, (await r.json())["error"]))
            r = await h.client.post(
                "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "real"}
            )
            out.append((r.status, (await r.json())["error"]))  # no key at all
            return out

    (no_root, *_), with_root = asyncio.run(go(None)), asyncio.run(go(root))
    assert no_root[0] == 403 and no_root[1]["param"] == "lora_path", no_root
    assert "--lora-root" in no_root[1]["message"]
    inside, *escapes, anonymous = with_root
    # Inside the root it is read (and refused for what it holds: no adapter_config.json).
    assert inside[0] == 400 and inside[1]["param"] == "lora_path", inside
    for status, err in escapes:
        assert status == 403 and err["param"] == "lora_path", (status, err)
        assert "outside the adapter root" in err["message"]
    assert anonymous[0] == 401


@pytest.mark.parametrize("huge", [10**30, -(2**63) - 1])
def test_a_schema_holding_an_integer_past_64_bits_is_400(client, huge) -> None:
    """Found by the 10,000-body fuzz run: llguidance raised ValueError (a 500)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"": huge}}}
    reply = client.post("/v1/chat/completions", json=chat(tools=[tool]))
    error(reply, 400, "tools[0].function.parameters")
    reply = client.post("/v1/completions", json=completion(guided_json={"maximum": huge}))
    error(reply, 400, "guided_json")
