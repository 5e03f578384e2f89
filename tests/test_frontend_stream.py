"""The HTTP API over scripted workers: response shapes, SSE, stop strings, n, logprobs,
usage, admission (429) and a client that goes away mid-stream."""

from __future__ import annotations

import asyncio

import pytest

from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from tests.frontend_fakes import CACHED, FakeWorker, frontend, run, sse_events

TEXT = "Héllo wörld 🙂 — 日本語 done."
EOS = 0
FUSED = ns_pb2.ROLE_FUSED


@pytest.fixture(scope="module")
def tiny(model_dir):
    return model_dir("tiny-llama")


@pytest.fixture(scope="module")
def script(tiny) -> list[int]:
    return Tokenizer(tiny).encode(TEXT)


def post(tiny, worker: FakeWorker, path: str, body: dict, stream: bool = False):
    """(status, JSON body or SSE events) of one request to a frontend over `worker`."""

    async def go():
        async with (
            frontend(tiny, {"w1": (FUSED, worker)}) as h,
            h.client.post(path, json={"model": "tiny-llama"} | body) as resp,
        ):
            data = await sse_events(resp) if stream else await resp.json()
            return resp.status, data

    return run(go())


def test_completion_response(tiny, script) -> None:
    status, body = post(
        tiny, FakeWorker(script), "/v1/completions", {"prompt": "hi", "max_tokens": 7}
    )
    assert status == 200, body
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "tiny-llama" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    tok = Tokenizer(tiny)
    assert choice == {
        "index": 0,
        "text": tok.decode(script[:7]),
        "logprobs": None,
        "finish_reason": "length",
    }
    n_prompt = len(tok.encode("hi"))
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 7,
        "total_tokens": n_prompt + 7,
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }


def test_completion_stream_until_eos(tiny, script) -> None:
    worker = FakeWorker(script, eos=EOS)
    body = {"prompt": [5, 6, 7], "max_tokens": 100, "stream": True}
    body["stream_options"] = {"include_usage": True}
    status, events = post(tiny, worker, "/v1/completions", body, stream=True)
    assert status == 200 and events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT  # EOS adds no text
    assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(script) + 1
    assert usage["usage"]["prompt_tokens"] == 3
    assert list(worker.requests[0].prompt_token_ids) == [5, 6, 7]


def test_chat_response_and_stream(tiny, script) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}
    status, resp = post(tiny, FakeWorker(script), "/v1/chat/completions", body)
    assert status == 200 and resp["object"] == "chat.completion"
    assert resp["id"].startswith("chatcmpl-")
    expected = Tokenizer(tiny).decode(script[:5])
    assert resp["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert resp["choices"][0]["finish_reason"] == "length"

    worker = FakeWorker(script, eos=EOS)
    status, events = post(tiny, worker, "/v1/chat/completions", body | {"stream": True}, True)
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == expected and chunks[-1]["choices"][0]["finish_reason"] == "length"
    # The chat template was applied: the prompt starts with <|im_start|> (id 1).
    assert worker.requests[0].prompt_token_ids[0] == 1


@pytest.mark.parametrize("per_message", [1, 3], ids=["one", "speculative"])
def test_stop_string_spanning_tokens_cuts_and_cancels_the_worker(tiny, script, per_message) -> None:
    """Also when tokens arrive several at a time (a speculating worker): the stop string may
    end inside a message."""
    worker = FakeWorker(script, delay=0.01, per_message=per_message)

    async def go():
        async with frontend(tiny, {"w1": (FUSED, worker)}) as h:
            body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 200, "stop": ["ö", "本"]}
            async with h.client.post("/v1/completions", json=body) as resp:
                data = await resp.json()
            await asyncio.wait_for(worker.cancelled.wait(), 5)  # it had tokens left to send
            return data

    body = run(go())
    assert body["choices"][0]["text"] == "Héllo w"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < len(script)


def test_n_choices_get_distinct_seeds(tiny, script) -> None:
    worker = FakeWorker(script)
    body = {"prompt": "hi", "max_tokens": 3, "n": 3, "seed": 11}
    status, resp = post(tiny, worker, "/v1/completions", body)
    assert status == 200
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert sorted(r.params.seed for r in worker.requests) == [11, 12, 13]
    assert len({r.request_id for r in worker.requests}) == 3
    assert resp["usage"]["completion_tokens"] == 9

    status, events = post(
        tiny, FakeWorker(script), "/v1/completions", body | {"stream": True}, True
    )
    by_choice = dict.fromkeys(range(3), "")
    for (choice,) in (c["choices"] for c in events[:-1]):
        by_choice[choice["index"]] += choice["text"]
    assert by_choice == {i: Tokenizer(tiny).decode(script[:3]) for i in range(3)}


def test_logprobs_formats(tiny, script) -> None:
    tok = Tokenizer(tiny)
    worker = FakeWorker(script)
    body = {"prompt": "a", "max_tokens": 3, "logprobs": 2}
    status, resp = post(tiny, worker, "/v1/completions", body)
    assert worker.requests[0].params.logprobs == 2
    lp = resp["choices"][0]["logprobs"]
    # "H", then two halves of "é": partial characters are shown as their bytes.
    assert lp["tokens"] == ["H", "bytes:\\xc3", "bytes:\\xa9"], lp["tokens"]
    assert lp["token_logprobs"] == [-0.5] * 3
    assert [len(t) for t in lp["top_logprobs"]] == [2, 2, 2]
    assert lp["text_offset"] == [0, 1, 1 + len("bytes:\\xc3")]

    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4}
    body |= {"logprobs": True, "top_logprobs": 1}
    status, resp = post(tiny, FakeWorker(script), "/v1/chat/completions", body)
    content = resp["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and content[0]["logprob"] == -0.5
    assert bytes(b for e in content for b in e["bytes"]).decode() == tok.decode(script[:4])
    assert [len(e["top_logprobs"]) for e in content] == [1] * 4


def test_ready_with_a_worker(tiny, script) -> None:
    async def go():
        async with frontend(tiny, {"w1": (FUSED, FakeWorker(script))}) as h:
            reply = await h.client.get("/ready")
            return reply.status, await reply.json()

    assert run(go()) == (200, {"status": "ready", "workers": 1})


def test_admission_limit_and_client_disconnect(tiny, script) -> None:
    """With one slot taken by a slow stream, the next request gets 429 at once; when the
    streaming client goes away, the worker call is cancelled and the slot frees up."""
    worker = FakeWorker(script * 50, delay=0.02)

    async def go():
        async with frontend(tiny, {"w1": (FUSED, worker)}, max_concurrent=1) as h:
            body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 500, "stream": True}
            resp = await h.client.post("/v1/completions", json=body)
            assert resp.status == 200
            await resp.content.readline()  # the first chunk arrived: the request is running
            async with h.client.post("/v1/completions", json=body) as refused:
                assert refused.status == 429
                err = (await refused.json())["error"]
                assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
            resp.close()  # the client goes away mid-stream
            await asyncio.wait_for(worker.cancelled.wait(), 5)
            while h.generator.admission.in_flight:
                await asyncio.sleep(0.01)
            short = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2}
            async with h.client.post("/v1/completions", json=short) as again:
                assert again.status == 200

    run(go())


def test_speculative_fields_reach_the_worker(tiny, script) -> None:
    """num_speculative_tokens as given; speculative_advice as token ids of its text."""
    worker = FakeWorker(script)
    advice = "def f(x):\n    return x\n"
    body = {"prompt": "hi", "max_tokens": 3, "num_speculative_tokens": 4}
    status, _ = post(tiny, worker, "/v1/completions", body | {"speculative_advice": advice})
    assert status == 200
    [request] = worker.requests
    assert request.params.num_speculative_tokens == 4
    want = Tokenizer(tiny).encode(advice, add_special_tokens=False)
    assert list(request.params.speculative_advice) == want
    worker = FakeWorker(script)
    assert post(tiny, worker, "/v1/completions", {"prompt": "hi", "max_tokens": 3})[0] == 200
    assert not worker.requests[0].params.HasField("num_speculative_tokens")


def test_tokens_several_at_a_time_keep_their_logprobs(tiny, script) -> None:
    body = {"prompt": "hi", "max_tokens": 7, "logprobs": 1}
    one = post(tiny, FakeWorker(script), "/v1/completions", body)[1]["choices"][0]
    status, resp = post(tiny, FakeWorker(script, per_message=3), "/v1/completions", body)
    assert status == 200
    assert resp["choices"][0] == one
    assert len(one["logprobs"]["tokens"]) == 7
