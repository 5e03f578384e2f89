"""Routing over scripted workers and master: block hash keys, PD plans, retries with
exclusion, resuming a stream on another worker, local fallback, and the gRPC ingress."""

from __future__ import annotations

import grpc
import pytest

from rtp_serve.core.block_hash import block_hash_keys, cache_salt
from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.services.common.pb import common_pb2, frontend_pb2, frontend_pb2_grpc
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from rtp_serve.services.frontend.grpc_api import FrontendServicer
from rtp_serve.services.frontend.router_client import Membership
from rtp_serve.services.master.packed_hashes import route_hashes
from tests.frontend_fakes import FakeMaster, FakeWorker, frontend, run, serve_grpc, sse_events

TEXT = "Routing tëst: ünïcode 🙂 and more words to stream along the way."
FUSED, PREFILL, DECODE = ns_pb2.ROLE_FUSED, ns_pb2.ROLE_PREFILL, ns_pb2.ROLE_DECODE
UNAVAILABLE, EXHAUSTED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def tiny(model_dir):
    return model_dir("tiny-llama")


@pytest.fixture(scope="module")
def tok(tiny) -> Tokenizer:
    return Tokenizer(tiny)


@pytest.fixture(scope="module")
def script(tok) -> list[int]:
    return tok.encode(TEXT)


def complete(tiny, workers, body: dict, master: FakeMaster | None = None, **kw):
    async def go():
        async with frontend(tiny, workers, master, **kw) as h:
            stream = body.get("stream", False)
            payload = {"model": "tiny-llama", "max_tokens": 6} | body
            async with h.client.post("/v1/completions", json=payload) as resp:
                return resp.status, await (sse_events(resp) if stream else resp.json())

    return run(go())


def test_a_request_line_puts_the_prediction_beside_the_workers_split(tiny, script, caplog):
    """--log-requests: one line per request at its first token, in the format the route
    benchmark reads; the worker's split comes from its first message."""
    from bench.route import first_token_lines

    master = FakeMaster([("w1", None)], predicted_ttft_s=0.25, predicted_wait_s=0.1,
                        predicted_prefill_s=0.12, predicted_fetch_s=0.03)  # fmt: skip
    worker = FakeWorker(script, first_split=(0.02, 0.05))

    async def go():
        async with frontend(tiny, {"w1": (FUSED, worker)}, master) as h:
            h.generator.log_requests = True
            payload = {"model": "tiny-llama", "max_tokens": 6, "prompt": list(range(10, 50))}
            async with h.client.post("/v1/completions", json=payload) as resp:
                return resp.status

    with caplog.at_level("INFO", logger="rtp_serve.services.frontend.generation"):
        assert run(go()) == 200
    (line,) = first_token_lines(caplog.text)
    assert line["worker"] == "w1" and line["prompt_tokens"] == "40"
    assert line["request"].startswith("cmpl-")  # the request's id, as its response has it
    assert {k: float(v) for k, v in line.items() if k.endswith("_s")} == pytest.approx({
        "predicted_s": 0.25, "predicted_wait_s": 0.1, "predicted_prefill_s": 0.12,
        "predicted_fetch_s": 0.03, "actual_s": float(line["actual_s"]), "queue_s": 0.02,
        "prefill_s": 0.05,
    })  # fmt: skip
    assert 0 < float(line["actual_s"]) < 10


def test_master_gets_the_workers_block_hashes(tiny, tok, script) -> None:
    master = FakeMaster([("w1", None)])
    prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16
    status, body = complete(tiny, {"w1": (FUSED, FakeWorker(script))}, {"prompt": prompt}, master)
    assert status == 200, body
    (req,) = master.requests
    salt = cache_salt(tiny, "float32")  # as LLMEngine computes it
    assert list(route_hashes(req)) == block_hash_keys(prompt, 16, salt)
    assert not req.block_hashes  # packed: one field, not one per block
    assert len(route_hashes(req)) == 2 and req.num_prompt_tokens == 40
    assert list(req.exclude) == []


def test_the_plans_remote_blocks_reach_the_worker(tiny, script) -> None:
    """What the master says the remote tier holds of the prompt goes to the worker, whose
    lookup asks it for no more (services/worker/tiers.py); a plan without it, nothing."""
    for said in (0, 3, None):
        worker = FakeWorker(script)
        master = FakeMaster([("w1", None)], **({} if said is None else {"remote_blocks": said}))
        status, body = complete(tiny, {"w1": (FUSED, worker)}, {"prompt": "x"}, master)
        assert status == 200, body
        (req,) = worker.requests
        assert (req.remote_blocks if req.HasField("remote_blocks") else None) == said


def test_a_request_releases_its_id_at_the_master_when_it_ends(tiny, script) -> None:
    """The master leases the id to the frontend that routed it (services/master/leases.py)."""
    master = FakeMaster([("w1", None)])
    status, body = complete(tiny, {"w1": (FUSED, FakeWorker(script))}, {"prompt": "x"}, master)
    assert status == 200, body
    (req,) = master.requests
    assert req.frontend_id.startswith("frontend-")
    assert master.released == [(req.request_id, req.frontend_id)]


def test_an_id_in_flight_through_another_frontend_is_a_409(tiny, script) -> None:
    master = FakeMaster(fail=grpc.StatusCode.ALREADY_EXISTS)
    status, body = complete(tiny, {"w1": (FUSED, FakeWorker(script))}, {"prompt": "x"}, master)
    assert status == 409, body
    assert body["error"]["code"] == "duplicate_request_id"


def test_pd_plan_sends_the_prefill_address(tiny, script) -> None:
    decode, prefill = FakeWorker(script), FakeWorker(script)
    master = FakeMaster([("d1", "p1")])
    workers = {"d1": (DECODE, decode), "p1": (PREFILL, prefill)}
    status, body = complete(tiny, workers, {"prompt": "hi"}, master)
    assert status == 200 and body["choices"][0]["text"] == Tokenizer(tiny).decode(script[:6])
    (req,) = decode.requests
    assert req.prefill_address and req.prefill_address == master.members["p1"].address
    assert prefill.requests == []  # the decode worker talks to it, not the frontend


def test_failed_worker_is_excluded_on_retry(tiny, script) -> None:
    bad, good = FakeWorker(script, fail=[EXHAUSTED]), FakeWorker(script)
    master = FakeMaster([("w1", None), ("w2", None)])
    status, body = complete(
        tiny, {"w1": (FUSED, bad), "w2": (FUSED, good)}, {"prompt": "x"}, master
    )
    assert status == 200, body
    assert [list(r.exclude) for r in master.requests] == [[], ["w1"]]
    assert len(bad.requests) == len(good.requests) == 1


def test_fallback_routing_retries_another_worker(tiny, script) -> None:
    # No master: round robin over the membership; w1 fails whenever it is picked.
    bad, good = FakeWorker(script, fail=[UNAVAILABLE] * 4), FakeWorker(script)
    workers = {"w1": (FUSED, bad), "w2": (FUSED, good)}

    async def go():
        async with frontend(tiny, workers) as h:
            for _ in range(4):
                body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 3}
                async with h.client.post("/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()

    run(go())
    assert len(good.requests) == 4 and len(bad.requests) >= 1


def test_no_worker_left_reports_the_workers_refusal(tiny, script) -> None:
    worker = FakeWorker(script, fail=[EXHAUSTED] * 3)
    status, body = complete(tiny, {"w1": (FUSED, worker)}, {"prompt": "x"})
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    worker = FakeWorker(script, fail=[UNAVAILABLE] * 3)
    assert complete(tiny, {"w1": (FUSED, worker)}, {"prompt": "x"})[0] == 503


def test_overloaded_answer_says_when_to_retry(tiny, script) -> None:
    worker = FakeWorker(script, fail=[EXHAUSTED] * 3)

    async def go():
        async with frontend(tiny, {"w1": (FUSED, worker)}) as h:
            body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 4}
            async with h.client.post("/v1/completions", json=body) as resp:
                return resp.status, resp.headers.get("Retry-After")

    status, retry_after = run(go())
    assert status == 429 and retry_after is not None and int(retry_after) > 0


def test_worker_rejecting_the_request_is_400_without_retry(tiny, script) -> None:
    worker = FakeWorker(script, fail=[grpc.StatusCode.INVALID_ARGUMENT])
    status, body = complete(tiny, {"w1": (FUSED, worker)}, {"prompt": "x"})
    assert status == 400 and "scripted failure" in body["error"]["message"]
    assert len(worker.requests) == 1


def test_unreachable_master_falls_back_to_membership(tiny, script) -> None:
    worker = FakeWorker(script)
    workers = {"w1": (FUSED, worker)}
    status, _ = complete(tiny, workers, {"prompt": "x"}, master_address="127.0.0.1:1")
    assert status == 200 and len(worker.requests) == 1


def test_stream_resumes_on_another_worker_after_a_crash(tiny, tok, script) -> None:
    prompt = tok.encode("resume me")
    n = len(prompt)
    first = FakeWorker(script, fail=[UNAVAILABLE], fail_after=3, base_prompt_len=n)
    second = FakeWorker(script, base_prompt_len=n)
    master = FakeMaster([("w1", None), ("w2", None)])
    workers = {"w1": (FUSED, first), "w2": (FUSED, second)}
    body = {"prompt": prompt, "max_tokens": 12, "stream": True}
    status, events = complete(tiny, workers, body, master)
    assert status == 200 and events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == tok.decode(script[:12])  # one uninterrupted stream
    (resumed,) = second.requests
    assert list(resumed.prompt_token_ids) == prompt + script[:3]
    assert resumed.params.max_tokens == 9


def test_a_failed_prefill_worker_is_routed_around_not_its_decode_worker(tiny, script) -> None:
    # d1's prefill worker p1 dies: d1 says so, and the retry keeps d1 but takes p2.
    decode = FakeWorker(script, fail=[UNAVAILABLE], blame_prefill=True)
    master = FakeMaster([("d1", "p1"), ("d1", "p2")])
    workers = {"d1": (DECODE, decode), "p1": (PREFILL, FakeWorker(script)),
               "p2": (PREFILL, FakeWorker(script))}  # fmt: skip
    status, body = complete(tiny, workers, {"prompt": "x"}, master)
    assert status == 200, body
    assert [list(r.exclude) for r in master.requests] == [[], ["p1"]]
    assert [r.prefill_address for r in decode.requests] == [
        master.members["p1"].address,
        master.members["p2"].address,
    ]


def test_a_sequence_moves_at_most_max_migrations_times(tiny, tok, script) -> None:
    # Every worker dies after 2 tokens: with one migration allowed, the second failure is
    # the answer (a 200 stream that ends in an error event), and the third worker is never
    # asked.
    prompt = tok.encode("crash everything")
    n = len(prompt)
    crashing = [FakeWorker(script, fail=[UNAVAILABLE], fail_after=2, base_prompt_len=n)
                for _ in range(3)]  # fmt: skip
    master = FakeMaster([("w1", None), ("w2", None), ("w3", None)])
    workers = {f"w{i + 1}": (FUSED, w) for i, w in enumerate(crashing)}

    names = ('rtp:request_migrations_total{model_name="tiny-llama"}',
             'rtp:request_migration_limit_reached_total{model_name="tiny-llama"}',
             'rtp:routes_total{model_name="tiny-llama",source="master"}')  # fmt: skip

    async def counts(h) -> list[float]:
        async with h.client.get("/metrics") as resp:
            lines = (await resp.text()).splitlines()
        return [sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(n)) for n in names]

    async def go():
        async with frontend(tiny, workers, master, max_migrations=1) as h:
            before = await counts(h)  # the registry is the process's: other tests count too
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "stream": True}
            async with h.client.post("/v1/completions", json=body) as resp:
                events = await sse_events(resp)
            return events, [b - a for a, b in zip(before, await counts(h), strict=True)]

    events, counted = run(go())
    assert any("error" in e for e in events if isinstance(e, dict)), events
    assert [len(w.requests) for w in crashing] == [1, 1, 0]
    assert counted == [1.0, 1.0, 2.0]  # one migration, then the limit; two master routes


def test_membership_round_robin_and_leave() -> None:
    def event(kind, mid, role):
        member = ns_pb2.Member(id=mid, role=role, address=f"{mid}:1")
        return ns_pb2.MembershipEvent(kind=kind, member=member)

    m = Membership()
    kinds = ns_pb2.MembershipEvent
    for mid, role in [("p1", PREFILL), ("d1", DECODE), ("d2", DECODE), ("master", 2)]:
        m.apply(event(kinds.KIND_SNAPSHOT, mid, role))
    assert m.has_route()
    picks = [m.pick() for _ in range(4)]
    assert [(r.prefill.id, r.decode.id) for r in picks] == [("p1", "d1"), ("p1", "d2")] * 2
    assert m.pick(frozenset({"d1"})).decode.id == "d2"
    m.apply(event(kinds.KIND_LEFT, "p1", PREFILL))
    assert not m.has_route() and m.pick() is None
    m.apply(event(kinds.KIND_JOINED, "f1", FUSED))
    assert m.pick().prefill is None and m.pick().decode.id == "f1"


def test_grpc_frontend_generate(tiny, tok, script) -> None:
    async def go():
        async with frontend(tiny, {"w1": (FUSED, FakeWorker(script, eos=0))}) as h:
            server, address = await serve_grpc(
                frontend_pb2_grpc.add_FrontendServicer_to_server, FrontendServicer(h.generator)
            )
            try:
                async with grpc.aio.insecure_channel(address) as ch:
                    stub = frontend_pb2_grpc.FrontendStub(ch)
                    request = frontend_pb2.FrontendGenerateRequest(
                        text="hi", params=common_pb2.SamplingParams(max_tokens=100), stop=["🙂"]
                    )
                    out = [m async for m in stub.Generate(request)]
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await stub.Generate(frontend_pb2.FrontendGenerateRequest()).read()
                    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    bad = frontend_pb2.FrontendGenerateRequest(
                        text="hi", params=common_pb2.SamplingParams(top_p=2.0)
                    )
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await stub.Generate(bad).read()
                    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    return out
            finally:
                await server.stop(grace=None)

    out = run(go())
    assert "".join(m.text for m in out) == TEXT[: TEXT.index("🙂")]
    assert out[-1].finished and out[-1].finish_reason == "stop"
    assert not any(m.finished for m in out[:-1])
    assert out[-1].prompt_tokens == len(tok.encode("hi")) and out[-1].cached_tokens == 16


def test_a_client_request_id_is_used_and_never_in_flight_twice(tiny, script) -> None:
    worker = FakeWorker(script, delay=0.05)

    async def go():
        async with frontend(tiny, {"w1": (FUSED, worker)}) as h:
            body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 8, "stream": True}
            named = {"X-Request-Id": "client-retry:42"}
            async with h.client.post("/v1/completions", json=body, headers=named) as first:
                assert first.headers["X-Request-Id"] == "client-retry:42"
                await first.content.readline()  # the first one is streaming now
                async with h.client.post("/v1/completions", json=body, headers=named) as dup:
                    refused = dup.status, await dup.json()
                events = await sse_events(first)
            # Once it ended, the id is free again; a bad id is refused by name.
            once_more = {**body, "stream": False}
            async with h.client.post("/v1/completions", json=once_more, headers=named) as r:
                again = r.status, (await r.json())["id"]
            bad = {"X-Request-Id": "no spaces allowed"}
            async with h.client.post("/v1/completions", json=once_more, headers=bad) as r:
                invalid = r.status, (await r.json())["error"]["param"]
            return refused, events, again, invalid

    refused, events, again, invalid = run(go())
    assert refused[0] == 409 and refused[1]["error"]["code"] == "duplicate_request_id"
    assert "client-retry:42" in refused[1]["error"]["message"]
    assert events[-1] == "[DONE]" and events[0]["id"] == "client-retry:42"
    assert again == (200, "client-retry:42")
    assert invalid == (400, "X-Request-Id")
    assert [r.request_id for r in worker.requests] == ["client-retry:42"] * 2  # never the dup


def test_best_of_returns_the_n_candidates_with_the_best_logprob_per_token(tiny, script) -> None:
    # Seeds 13, 14, 15 score -1.1, -0.5 and -0.6 per token: n=2 of best_of=3 are the last two.
    worker = FakeWorker(script, logprob_by_seed=True)
    workers = {"w1": (FUSED, worker)}
    body = {"prompt": "x", "max_tokens": 4, "n": 2, "best_of": 3, "seed": 13, "logprobs": 1}
    status, out = complete(tiny, workers, body)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1]
    firsts = [c["logprobs"]["token_logprobs"][0] for c in out["choices"]]
    assert firsts == pytest.approx([-0.5, -0.6])
    assert out["usage"]["completion_tokens"] == 3 * 4  # every candidate was generated
    assert sorted(r.params.seed for r in worker.requests) == [13, 14, 15]

    # Without logprobs asked, the candidates still carry the sampled tokens' (for ranking),
    # and the answer shows none.
    worker = FakeWorker(script, logprob_by_seed=True)
    status, out = complete(tiny, {"w1": (FUSED, worker)}, {"prompt": "x", "best_of": 2})
    assert status == 200 and len(out["choices"]) == 1 and out["choices"][0]["logprobs"] is None
    assert [r.params.logprobs for r in worker.requests] == [0, 0]
    for bad in ({"best_of": 1, "n": 2}, {"best_of": 9}):
        status, out = complete(tiny, {"w1": (FUSED, FakeWorker(script))}, {"prompt": "x"} | bad)
        assert status == 400 and out["error"]["param"] == "best_of", (bad, out)
    # (best_of > n with stream is refused by the schema: test_frontend_unit.)
