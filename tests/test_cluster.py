"""The whole cluster, started by the launcher, through the official `openai` client.

One PD cluster (2 prefill, 1 decode) and one fused cluster (2 workers); outputs are
compared with the in-process engine on the same model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import httpx
import openai
import pytest

from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.pb import (
    cache_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    master_pb2,
    master_pb2_grpc,
    nameservice_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.cluster import launch

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\nclass Config:",
    "The quick brown fox",
    "for i in range(10):\n    print(i)\n",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return str(model_dir("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model):
    """Greedy outputs of the in-process engine: token ids and text per prompt string."""
    llm = LLM(model, num_kv_blocks=256)
    cache: dict[str, tuple[list[int], str, str]] = {}

    def get(prompt: str | list[int], max_tokens: int = MAX_TOKENS):
        key = (str(prompt), max_tokens)
        if key not in cache:
            out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
            cache[key] = (out.token_ids, out.text, out.finish_reason)
        return cache[key]

    get.tokenizer = llm.tokenizer
    return get


@pytest.fixture(scope="module", params=["pd", "fused"])
def cluster(request, model, tmp_path_factory):
    flags = ("--prefill", "2", "--decode", "1") if request.param == "pd" else ("--fused", "2")
    # Speculation on (n-gram; in PD the decode worker speculates): every test below checks
    # greedy texts against the engine without it, so they check that it changes nothing.
    flags += ("--speculative", "ngram")
    with launch(model, tmp_path_factory.mktemp(request.param), *flags) as c:
        c.mode = request.param
        yield c
    assert c.left_running == [], "stopping the launcher left processes running"


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _model_id(cluster) -> str:
    return _client(cluster).models.list().data[0].id


def test_up_means_every_worker_is_registered(cluster):
    """The launcher reports the cluster up only once the frontend knows every worker it
    started (first in this module: nothing has waited since the launch)."""
    assert len(cluster.workers()) == (3 if cluster.mode == "pd" else 2)


def test_completions_match_engine(cluster, reference):
    client, model_id = _client(cluster), _model_id(cluster)
    for prompt in PROMPTS:
        ids, text, reason = reference(prompt)
        out = client.completions.create(
            model=model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.choices[0].text == text
        assert out.choices[0].finish_reason == reason
        assert out.usage.completion_tokens == len(ids)
        assert out.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        streamed = client.completions.create(
            model=model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == len(ids)


def test_token_id_prompt_and_cached_tokens(cluster, reference):
    client, model_id = _client(cluster), _model_id(cluster)
    prompt_ids = reference.tokenizer.encode("\n".join(PROMPTS) * 3)[:80]
    text = reference(prompt_ids)[1]
    # Every worker that served the prompt caches it; with two candidates the master may
    # spread the first repeats, but by the third one some worker must report a hit.
    usages = []
    for _ in range(3):
        out = client.completions.create(
            model=model_id, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.choices[0].text == text
        usages.append(out.usage)
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert max(u.prompt_tokens_details.cached_tokens for u in usages) == 64  # 4 full blocks of 16


def test_chat_matches_engine_with_template(cluster, reference):
    client, model_id = _client(cluster), _model_id(cluster)
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list."},
    ]
    prompt = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids, text, reason = reference(prompt)
    out = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].message.content == text
    assert out.choices[0].finish_reason == reason
    assert out.usage.completion_tokens == len(ids)
    stream = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_32_concurrent_streams_then_pools_are_clean(cluster, reference):
    model_id = _model_id(cluster)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} # variant {i}" for i in range(32)]

    async def one(client, prompt):
        stream = await client.completions.create(
            model=model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        client = openai.AsyncOpenAI(
            base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120
        )
        return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(main())
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == reference(prompt)[1]
    for worker_id, stats in cluster.wait_idle().items():
        assert stats.integrity_ok, (worker_id, stats.integrity_error)
        assert stats.held_blocks == 0, (worker_id, stats)


ERRORS = [
    # (body, status, param or message fragment)
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "n": 1000}, 400, "n"),
    ({"max_tokens": 5}, 400, "prompt"),
    ({"prompt": [10**7], "max_tokens": 5}, 400, "prompt"),
]


def test_grpc_ingress_carries_logprobs_as_http_does(cluster):
    """Frontend.Generate with params.logprobs: each token's logprob and its top-n, the same
    numbers the HTTP API returns for the same greedy request."""
    prompt, top_n = PROMPTS[2], 2
    body = {"model": _model_id(cluster), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "logprobs": top_n}  # fmt: skip
    reply = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    http = reply.json()["choices"][0]["logprobs"]
    (frontend,) = cluster.members(nameservice_pb2.ROLE_FRONTEND)
    request = frontend_pb2.FrontendGenerateRequest(text=prompt)
    request.params.max_tokens, request.params.logprobs = MAX_TOKENS, top_n

    async def generate() -> list[frontend_pb2.FrontendGenerateResponse]:
        async with grpc_util.channel(frontend.address) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            return [m async for m in stub.Generate(request, timeout=60)]

    out = asyncio.run(generate())
    logprobs = [lp for m in out for lp in m.logprobs]
    assert [lp.token_id for lp in logprobs] == [t for m in out for t in m.token_ids]
    assert len(logprobs) == len(http["token_logprobs"]) > 0
    assert [lp.logprob for lp in logprobs] == pytest.approx(http["token_logprobs"], abs=1e-5)
    for lp, alternatives in zip(logprobs, http["top_logprobs"], strict=True):
        assert len(lp.top) == top_n
        # Two alternatives may share a text (one key in HTTP's dict): each value is one of ours.
        for value in alternatives.values():
            assert any(value == pytest.approx(t.logprob, abs=1e-5) for t in lp.top)


def test_error_table(cluster):
    model_id = _model_id(cluster)
    with httpx.Client(base_url=cluster.url, timeout=30) as http:
        for body, status, needle in ERRORS:
            reply = http.post("/v1/completions", json={"model": model_id, **body})
            assert reply.status_code == status, (body, reply.text)
            error = reply.json()["error"]
            assert needle in (error.get("param") or "") + error["message"], (body, error)
        reply = http.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert reply.status_code == 400 and reply.json()["error"]["message"]
        reply = http.post(
            "/v1/completions",
            content=b'{"prompt": "\xff\xfe"}',
            headers={"content-type": "application/json"},
        )
        assert reply.status_code == 400
        reply = http.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"})
        assert reply.status_code == 404 and reply.json()["error"]
        too_long = "x " * 5000
        reply = http.post(
            "/v1/completions", json={"model": model_id, "prompt": too_long, "max_tokens": 4}
        )
        assert reply.status_code == 400 and "2048" in reply.json()["error"]["message"]
        # The cluster still serves a normal request afterwards.
        ok = http.post("/v1/completions", json={"model": model_id, "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_client_disconnect_frees_blocks(cluster):
    model_id = _model_id(cluster)
    body = {
        "model": model_id,
        "prompt": PROMPTS[1],
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(base_url=cluster.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break  # leave mid-stream
    stats = cluster.wait_idle()
    for worker_id, s in stats.items():
        assert s.held_blocks == 0 and s.num_running == 0, (worker_id, s)


def test_a_prefix_computed_on_one_worker_is_fetched_by_another(cluster, reference, model):
    """Every role uses the remote tier: the blocks one fused worker served twice are written
    back to the cache service (the default `--remote-write reused`), and another fused
    worker imports them instead of computing."""
    if cluster.mode != "fused":
        pytest.skip("prefill workers' use of the tier is covered by the PD cluster's requests")
    from rtp_serve.core.block_hash import block_hash_keys, cache_salt
    from rtp_serve.services.common.convert import params_to_pb
    from rtp_serve.services.common.pb import cache_pb2

    deadline = time.monotonic() + 30
    while len(workers := cluster.workers()) < 2:
        assert time.monotonic() < deadline, "the second fused worker never registered"
        time.sleep(0.1)
    first, second = workers[:2]
    prompt = reference.tokenizer.encode("a prefix that travels between workers, " * 8)[:70]
    keys = block_hash_keys(prompt, 16, cache_salt(model, "float32"))[:4]
    params = params_to_pb(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))

    async def generate(address: str, rid: str):
        async with grpc_util.channel(address) as ch:
            request = worker_pb2.GenerateRequest(
                request_id=rid, prompt_token_ids=prompt, params=params
            )
            return [m async for m in worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=30)]

    (cache,) = cluster.members(nameservice_pb2.ROLE_CACHE)

    async def stored() -> int:
        async with grpc_util.channel(cache.address) as ch:
            reply = await cache_pb2_grpc.CacheStub(ch).Exists(
                cache_pb2.ExistsRequest(block_hashes=keys), timeout=5
            )
            return reply.num_prefix

    async def run():
        computed = await generate(first.address, "tier-a")
        await generate(first.address, "tier-a2")  # reused: now written back
        deadline = time.monotonic() + 10
        while await stored() < len(keys):  # the write-back runs off the request path
            assert time.monotonic() < deadline, "the blocks never reached the cache service"
            await asyncio.sleep(0.05)
        return computed, await generate(second.address, "tier-b")

    computed, fetched = asyncio.run(run())
    assert computed[-1].num_cached_tokens == 0
    assert fetched[-1].num_cached_tokens == 64  # four blocks imported from the remote tier
    tokens = [[t for m in msgs for t in m.token_ids] for msgs in (computed, fetched)]
    assert tokens[0] == tokens[1] == reference(prompt)[0]


def test_remote_tier_down_degrades_not_fails(cluster, reference):
    """Kill the cache service and Redis: requests still succeed (blocks are recomputed)."""
    for entry in cluster.info["pids"]:
        if entry["name"] in ("cache", "redis"):
            os.kill(entry["pid"], signal.SIGKILL)
    client, model_id = _client(cluster), _model_id(cluster)
    for prompt in [*PROMPTS, "a prompt nobody has sent before, long enough " * 4]:
        out = client.completions.create(
            model=model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.choices[0].text == reference(prompt)[1]


def _route(master: str, n: int) -> list[str]:
    async def run():
        async with grpc_util.channel(master) as ch:
            stub = master_pb2_grpc.MasterStub(ch)
            plans = [
                await stub.Route(
                    master_pb2.RouteRequest(request_id=f"probe{i}", num_prompt_tokens=8), timeout=5
                )
                for i in range(n)
            ]
        return [plan.decode.id for plan in plans]

    return asyncio.run(run())


def test_master_index_equals_what_the_workers_hold(cluster):
    """The master's prefix index (Master.Index) is exactly the union of the workers'
    snapshots (Worker.Snapshot) and the cache instances' (Cache.Snapshot: the remote tier,
    which the workers write back to), once traffic stops; its metrics say how it got there."""
    client, model_id = _client(cluster), _model_id(cluster)
    for prompt in PROMPTS:
        client.completions.create(model=model_id, prompt=prompt * 4, max_tokens=2)
    master = cluster.members(nameservice_pb2.ROLE_MASTER)[0]
    workers = cluster.workers()
    caches = cluster.members(nameservice_pb2.ROLE_CACHE)

    async def state() -> tuple[dict[str, set[bytes]], dict[str, set[bytes]]]:
        async with grpc_util.channel(master.address) as ch:
            reply = await master_pb2_grpc.MasterStub(ch).Index(master_pb2.IndexRequest())
        index = {w.worker_id: set(w.block_hashes) for w in reply.workers if w.block_hashes}
        truth = {}
        for m in [*workers, *caches]:
            async with grpc_util.channel(m.address) as ch:
                stub = (
                    cache_pb2_grpc.CacheStub(ch)
                    if m.role == nameservice_pb2.ROLE_CACHE
                    else worker_pb2_grpc.WorkerStub(ch)
                )
                try:
                    snap = await stub.Snapshot(worker_pb2.KVSnapshotRequest(), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    # A cache instance an earlier test killed (the remote-tier-down test) is
                    # listed until its TTL runs out: it holds nothing, and the master must
                    # drop its part of the index when it leaves.
                    if (
                        m.role != nameservice_pb2.ROLE_CACHE
                        or exc.code() != grpc.StatusCode.UNAVAILABLE
                    ):
                        raise
                    continue
            assert snap.worker_id == m.id
            if snap.block_hashes:
                truth[m.id] = set(snap.block_hashes)
        return index, truth

    deadline = time.monotonic() + 10
    while (got := asyncio.run(state()))[0] != got[1] and time.monotonic() < deadline:
        time.sleep(0.1)
    index, truth = got
    assert index == truth and truth
    text = httpx.get(f"http://{master.metrics_address}/metrics", timeout=5).text
    resyncs = [line for line in text.splitlines() if line.startswith("rtp:index_resyncs_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in resyncs) >= len(workers)  # each once
    for worker_id, hashes in truth.items():
        assert f'rtp:index_blocks{{worker="{worker_id}"}} {float(len(hashes))}' in text


def test_the_workers_speculated(cluster, reference):
    """Speculation runs in the cluster (in PD on the decode worker): a request whose advice
    is the text it will write drafts from it, and its output is still the engine's."""
    prompt = PROMPTS[0]
    want = reference(prompt)[1]
    body = {"model": _model_id(cluster), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "speculative_advice": prompt + want}  # fmt: skip
    reply = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == want
    roles = (nameservice_pb2.ROLE_DECODE, nameservice_pb2.ROLE_FUSED)

    def drafted() -> float:
        total = 0.0
        for m in cluster.workers():
            if m.role in roles:
                text = httpx.get(f"http://{m.metrics_address}/metrics", timeout=5).text
                total += sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("rtp:spec_decode_num_accepted_tokens_total{")
                )
        return total

    deadline = time.monotonic() + 10  # the counters follow the load reports
    while drafted() == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert drafted() > 0


def test_sigkill_worker_is_dropped_and_traffic_moves(cluster, reference):
    """Last test of the module: it leaves the cluster one worker short."""
    if cluster.mode != "fused":
        pytest.skip("run once, on the fused cluster (two interchangeable workers)")
    before = {m.id for m in cluster.workers()}
    pid = next(p["pid"] for p in cluster.info["pids"] if p["name"] == "fused")
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while len(cluster.workers()) == len(before) and time.monotonic() - killed_at < 5.0:
        time.sleep(0.05)
    dropped_after = time.monotonic() - killed_at
    survivors = {m.id for m in cluster.workers()}
    assert len(survivors) == len(before) - 1
    assert dropped_after <= 1.0 + 1.0 + 0.25  # TTL (1 s here) + 1 s, plus polling slack
    master = cluster.members(nameservice_pb2.ROLE_MASTER)[0].address
    assert set(_route(master, 8)) <= survivors
    client, model_id = _client(cluster), _model_id(cluster)
    for prompt in PROMPTS:
        out = client.completions.create(
            model=model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.choices[0].text == reference(prompt)[1]
