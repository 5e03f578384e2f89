"""The frontend's HTTP API in front of no worker: request validation, exact statuses and
OpenAI error bodies. (Streaming, routing and retries over scripted workers are in
test_frontend_stream.py; detokenization in test_frontend_detok.py.)"""

from __future__ import annotations

import json
import re
import selectors
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from rtp_serve.services.frontend.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from tests.frontend_fakes import frontend, run

MODEL = "tiny-llama"  # the served name: the model directory's name


@pytest.fixture(scope="module")
def tiny(model_dir):
    return model_dir("tiny-llama")


def call(tiny, method: str, path: str, body=None, raw: bytes | None = None):
    """(status, JSON body) of one request to a frontend that knows no worker."""

    async def go():
        async with frontend(tiny, {}) as h:
            kwargs = {"data": raw} if raw is not None else {"json": body}
            async with h.client.request(method, path, **kwargs) as resp:
                return resp.status, await resp.json()

    return run(go())


def completion(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4} | kw


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | kw


def assert_error(result, status: int, param: str | None = None, text: str = "") -> dict:
    got_status, body = result
    assert got_status == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert text in err["message"], err
    return err


def test_models_health_ready(tiny) -> None:
    status, body = call(tiny, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL] and body["data"][0]["object"] == "model"
    assert call(tiny, "GET", "/health")[0] == 200
    assert call(tiny, "GET", "/ready")[0] == 503  # no worker known


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b"[1, 2]", "must be a JSON object"),
    ],
)
def test_malformed_bodies(tiny, raw: bytes, text: str) -> None:
    err = assert_error(call(tiny, "POST", "/v1/completions", raw=raw), 400, None, text)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "prompt"),
        ({"prompt": "x"}, "model"),
        (completion(max_tokens=0), "max_tokens"),
        (completion(max_tokens=-3), "max_tokens"),
        (completion(max_tokens="8"), "max_tokens"),
        (completion(temperature=-0.5), "temperature"),
        (completion(temperature="hot"), "temperature"),
        (completion(top_p=0), "top_p"),
        (completion(top_p=1.5), "top_p"),
        (completion(top_k=-2), "top_k"),
        (completion(n=9), "n"),
        (completion(n=0), "n"),
        (completion(logprobs=21), "logprobs"),
        (completion(stop=[1, 2]), "stop"),
        (completion(min_tokens=5), "min_tokens"),
        (completion(prompt=[1, 2, 999999]), "prompt"),
        (completion(prompt=[1, -1]), "prompt"),
        (completion(prompt=["a", "b"]), "prompt"),
        (completion(prompt=""), "prompt"),
        (completion(prompt=[]), "prompt"),
        (completion(prompt={"x": 1}), "prompt"),
        (completion(stop_token_ids=[10**9]), "stop_token_ids"),
        (completion(stream_options={"include_usage": True}), "stream_options"),
        (completion(stream="yes"), "stream"),
        (completion(echo=True, logprobs=1), "echo"),
        (completion(best_of=3, stream=True), "best_of"),
        (completion(suffix="x"), "suffix"),
        (completion(presence_penalty=2.5), "presence_penalty"),
        (completion(frequency_penalty="1"), "frequency_penalty"),
        (completion(repetition_penalty=0), "repetition_penalty"),
        (completion(logit_bias={"a": 1}), "logit_bias"),
        (completion(logit_bias={"5": 101}), "logit_bias"),
        (completion(logit_bias={"999999": 1}), "logit_bias"),
        (completion(timeout=0), "timeout"),
        (completion(timeout=-1.5), "timeout"),
        (completion(timeout="3"), "timeout"),
        (completion(timeout=True), "timeout"),
        (completion(num_speculative_tokens=17), "num_speculative_tokens"),
        (completion(num_speculative_tokens=-1), "num_speculative_tokens"),
        (completion(speculative_advice=[1, 2]), "speculative_advice"),
    ],
)
def test_invalid_completion_parameters(tiny, body: dict, param: str) -> None:
    assert_error(call(tiny, "POST", "/v1/completions", body), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        (chat(messages=[]), "messages"),
        (chat(messages=["hi"]), "messages[0]"),
        (chat(messages=[{"content": "hi"}]), "messages[0].role"),
        (chat(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content",
        ),
        (chat(top_logprobs=3), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=50), "top_logprobs"),  # the chat field that asks for them
        (chat(max_completion_tokens=0), "max_tokens"),
        (chat(logprobs="yes"), "logprobs"),
        (chat(tools=[{"type": "function"}]), "tools[0].function"),
        (chat(timeout=0.0), "timeout"),
    ],
)
def test_invalid_chat_parameters(tiny, body: dict, param: str) -> None:
    assert_error(call(tiny, "POST", "/v1/chat/completions", body), 400, param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", completion(foo=1), "foo"),
        ("/v1/chat/completions", chat(foo=1), "foo"),
        ("/v1/completions", completion(response_format={"type": "xml"}), "response_format.type"),
        ("/v1/chat/completions", chat(guided_decoding_backend="x"), "guided_decoding_backend"),
        ("/v1/chat/completions", chat(modalities=["audio"]), "modalities"),
        ("/v1/chat/completions", chat(echo=True), "echo"),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "x": 1}]), None),
    ],
)
def test_unsupported_fields_are_refused_by_name(tiny, path, body, param) -> None:
    param = param or "messages[0].x"
    err = assert_error(call(tiny, "POST", path, body), 400, param)
    assert param in err["message"]


def test_no_op_values_of_unimplemented_fields_are_accepted() -> None:
    body = completion(suffix="", best_of=1, response_format={"type": "text"})
    assert parse(CompletionRequest, body).options.max_tokens == 4


def test_harmless_openai_client_fields_are_accepted() -> None:
    extra = {"service_tier": "auto", "store": False, "metadata": {"k": "v"}, "user": "u"}
    extra |= {"prompt_cache_key": "p", "safety_identifier": "s"}
    chat_extra = extra | {"parallel_tool_calls": False, "stream": True}
    chat_extra |= {"stream_options": {"include_usage": True}}
    assert parse(CompletionRequest, completion(**extra)).options.session_id == "u"
    assert parse(ChatCompletionRequest, chat(**chat_extra)).include_usage


def test_penalties_and_logit_bias_reach_the_options() -> None:
    body = completion(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2)
    o = parse(CompletionRequest, body | {"logit_bias": {"7": -100, "3": 2.5}}).options
    assert (o.presence_penalty, o.frequency_penalty, o.repetition_penalty) == (0.5, -1, 1.2)
    assert o.logit_bias == ((7, -100), (3, 2.5))


def test_tokenize_and_detokenize_as_transformers(tiny) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny)
    text = "def f(x):\n    return x  # \u00e9"
    status, body = call(tiny, "POST", "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200, body
    assert body["tokens"] == hf.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 2048 and body["token_strs"] is None
    messages = [{"role": "user", "content": "hi"}]
    status, chat_body = call(
        tiny, "POST", "/tokenize", {"messages": messages, "return_token_strs": True}
    )
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat_body["tokens"] == hf.encode(want, add_special_tokens=False)
    assert chat_body["token_strs"] == hf.convert_ids_to_tokens(chat_body["tokens"])
    status, detok = call(tiny, "POST", "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert status == 200 and detok["prompt"] == hf.decode(body["tokens"]) == text
    assert_error(call(tiny, "POST", "/detokenize", {"tokens": [10**7]}), 400, "tokens")
    assert_error(call(tiny, "POST", "/detokenize", {"tokens": ["a"]}), 400, "tokens[0]")
    assert_error(call(tiny, "POST", "/tokenize", {"prompt": "x", "foo": 1}), 400, "foo")
    assert_error(call(tiny, "POST", "/tokenize", {"prompt": "x", "model": "gpt"}), 404, "model")


def test_openapi_describes_the_request_models(tiny) -> None:
    status, spec = call(tiny, "GET", "/openapi.json")
    assert status == 200 and spec["openapi"].startswith("3.")
    schemas = spec["components"]["schemas"]
    for path, model in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ]:
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert ref["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert {"model", "stream", "temperature"} <= set(schemas[model]["properties"])
        assert schemas[model]["additionalProperties"] is False
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    for field in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"):
        assert field in schemas["CompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(
        schemas["ChatCompletionRequest"]["properties"]
    )
    assert {"Tool", "FunctionDef", "NamedToolChoice"} <= set(schemas)
    for path in ("/tokenize", "/detokenize"):
        assert "requestBody" in spec["paths"][path]["post"]
    timeout = schemas["CompletionRequest"]["properties"]["timeout"]["anyOf"][0]
    assert timeout["exclusiveMinimum"] == 0 and "504" in timeout["description"]


def test_unknown_model_is_404(tiny) -> None:
    for path, body in [("/v1/completions", completion()), ("/v1/chat/completions", chat())]:
        err = assert_error(call(tiny, "POST", path, body | {"model": "gpt-9"}), 404, "model")
        assert err["code"] == "model_not_found" and "gpt-9" in err["message"]


def test_prompt_longer_than_the_context(tiny) -> None:
    # config.json: max_position_embeddings 2048
    err = assert_error(
        call(tiny, "POST", "/v1/completions", completion(prompt=[5] * 3000)), 400, "prompt"
    )
    assert "2048" in err["message"] and "3000" in err["message"]
    err = assert_error(
        call(tiny, "POST", "/v1/completions", completion(prompt=[5] * 2000, max_tokens=100)),
        400,
        "max_tokens",
    )
    assert "2048" in err["message"] and "2100" in err["message"]


def test_valid_request_without_workers_is_503(tiny) -> None:
    err = assert_error(call(tiny, "POST", "/v1/completions", completion()), 503)
    assert err["code"] == "service_unavailable"
    assert_error(call(tiny, "POST", "/v1/chat/completions", chat(stream=True)), 503)


def test_unknown_path_and_method_are_json(tiny) -> None:
    assert call(tiny, "GET", "/v1/nothing")[0] == 404
    assert call(tiny, "GET", "/v1/completions")[0] == 405


def test_schema_parses_openai_fields() -> None:
    req = parse(
        CompletionRequest,
        completion(prompt=[[1, 2, 3]], stop="\n", seed=7, n=2, logprobs=2, stream=True)
        | {"stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": 1},
    )
    assert req.prompt == [1, 2, 3] and req.stream and req.include_usage
    o = req.options
    assert (o.stop, o.seed, o.n, o.logprobs, o.ignore_eos, o.min_tokens) == (
        ("\n",),
        7,
        2,
        2,
        True,
        1,
    )
    req = parse(
        ChatCompletionRequest,
        chat(max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=3, user="u1"),
    )
    assert req.options.max_tokens == 9 and req.options.logprobs == 3
    assert req.options.session_id == "u1"
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parse(
        ChatCompletionRequest, chat(messages=[{"role": "user", "content": content}])
    ).message_dicts() == [{"role": "user", "content": "ab"}]
    assert parse(ChatCompletionRequest, chat(logprobs=False)).options.logprobs is None


def test_frontend_imports_no_torch() -> None:
    code = (
        "import sys, rtp_serve.services.frontend.main, rtp_serve.services.frontend.http_api, "
        "rtp_serve.services.frontend.grpc_api; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("flag", ["--nats-url=nats://127.0.0.1:4222", "--nats-token=t"])
def test_the_frontend_takes_no_nats_flags(flag: str) -> None:
    """It never connects to NATS, so it accepts no flag that would say it does."""
    from rtp_serve.services.cli import build_parser

    argv = ["frontend", "--model", "m", "--nameservice", "127.0.0.1:1"]
    assert build_parser(argv).parse_args(argv).nameservice == "127.0.0.1:1"
    with pytest.raises(SystemExit):
        build_parser([*argv, flag]).parse_args([*argv, flag])


def test_serve_starts_logs_its_url_and_stops_on_sigterm(tiny) -> None:
    argv = [sys.executable, "-m", "rtp_serve.services.cli", "frontend", "--model", str(tiny)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        url = _wait_for_url(proc, deadline=time.monotonic() + 30)
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as reply:
            assert json.load(reply)["data"][0]["id"] == MODEL
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for_url(proc: subprocess.Popen, deadline: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if sel.select(timeout=max(0.0, deadline - time.monotonic())):
            line = proc.stderr.readline()
            if not line:
                break
            found = re.search(r"frontend ready url=(\S+)", line)
            if found:
                return found.group(1)
    raise AssertionError("the frontend did not log its URL")
