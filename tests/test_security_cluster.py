"""A launched cluster with everything on: `rtp-serve up --fused 2 --tls --api-key ...
--metrics-key ... --nats-token ... --redis-password ... --kv-integrity-key ...`.

- every HTTP endpoint without a key, with a wrong key and with the right one (and the
  official openai client), /health and /ready open, /metrics behind its own key;
- every internal gRPC service (nameservice, master, cache, both workers, the frontend's
  gRPC ingress) refuses clients without a cluster certificate; NATS and Redis refuse
  clients without the secret; no secret on any process's command line;
- a poisoned block in the cache tiers is detected, counted and never used: the output
  equals the in-process engine's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import httpx
import nats as nats_py
import openai
import pytest
import redis as redis_py
from prometheus_client.parser import text_string_to_metric_families

from rtp_serve.core.block_hash import block_hash_keys, cache_salt
from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.convert import params_to_pb
from rtp_serve.services.common.pb import (
    cache_pb2,
    cache_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    master_pb2,
    master_pb2_grpc,
    nameservice_pb2,
    nameservice_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from rtp_serve.services.common.tls import TlsConfig
from tests.cluster import launch
from tests.mtls import assert_members_only, issue

API_KEYS = ("sk-test-first", "sk-test-second")
METRICS_KEY = "metrics-test-key"
NATS_TOKEN = "nats-test-token"
REDIS_PASSWORD = "redis-test-password"
KV_KEY = "kv-test-secret"
ADMIN_KEY = "admin-test-key"
SECRETS = (*API_KEYS, METRICS_KEY, NATS_TOKEN, REDIS_PASSWORD, KV_KEY, ADMIN_KEY)
PRIORITY_FLOOR = -1  # more urgent than the default floor (0): the flag must reach the frontend
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return str(model_dir("tiny-llama"))


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    lora_root = tmp_path_factory.mktemp("adapters")
    flags = ["--fused", "2", "--tls", "--metrics-key", METRICS_KEY, "--nats-token", NATS_TOKEN,
             "--redis-password", REDIS_PASSWORD, "--kv-integrity-key", KV_KEY,
             "--admin-key", ADMIN_KEY, "--lora-root", str(lora_root),
             "--priority-floor", str(PRIORITY_FLOOR)]  # fmt: skip
    for key in API_KEYS:
        flags += ["--api-key", key]
    with launch(model, tmp_path_factory.mktemp("secure"), *flags) as c:
        yield c
    assert c.left_running == []


@pytest.fixture(scope="module")
def member(cluster) -> TlsConfig:
    tls = cluster.info["tls"]
    return TlsConfig.load(tls["cert"], tls["key"], tls["ca"])


def _members(cluster, tls: TlsConfig, role: int) -> list[nameservice_pb2.Member]:
    async def run():
        async with grpc_util.channel(cluster.nameservice, tls) as ch:
            reply = await nameservice_pb2_grpc.NameServiceStub(ch).List(
                nameservice_pb2.ListRequest(role=role), timeout=5
            )
        return list(reply.members)

    deadline = time.monotonic() + 30
    while not (members := run_sync(run())) or (
        role == nameservice_pb2.ROLE_FUSED and len(members) < 2
    ):
        assert time.monotonic() < deadline, f"role {role} never registered"
        time.sleep(0.1)
    return members


def run_sync(coro):
    return asyncio.run(coro)


# -- HTTP ----------------------------------------------------------------------------------
def _endpoints(model_id: str) -> list[tuple[str, str, dict | None]]:
    prompt = {"model": model_id, "prompt": "hi", "max_tokens": 2}
    chat = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", prompt),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/tokenize", {"model": model_id, "prompt": "hi"}),
        ("POST", "/detokenize", {"model": model_id, "tokens": [1, 2]}),
        ("GET", "/openapi.json", None),
    ]


def _assert_401(reply: httpx.Response) -> None:
    assert reply.status_code == 401, reply.text
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert error["message"] and error["param"] is None


def test_every_endpoint_needs_an_api_key(cluster):
    def auth(key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        model_id = http.get("/v1/models", headers=auth(API_KEYS[0])).json()["data"][0]["id"]
        for method, path, body in _endpoints(model_id):
            for key in (None, "sk-wrong", API_KEYS[0][:-1], METRICS_KEY):
                _assert_401(http.request(method, path, json=body, headers=auth(key)))
            _assert_401(
                http.request(method, path, json=body, headers={"Authorization": API_KEYS[0]})
            )
            for key in API_KEYS:
                reply = http.request(method, path, json=body, headers=auth(key))
                assert reply.status_code == 200, (path, reply.text)
        for path in ("/health", "/ready"):
            assert http.get(path).status_code == 200
        for key in (None, "sk-wrong", API_KEYS[0]):  # /metrics wants its own key
            _assert_401(http.get("/metrics", headers=auth(key)))
        scraped = http.get("/metrics", headers=auth(METRICS_KEY))
        assert scraped.status_code == 200 and "rtp:" in scraped.text
        assert 'status="401"' in scraped.text  # refusals are counted


def test_openai_client_with_and_without_the_key(cluster, model):
    bad = openai.OpenAI(base_url=cluster.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key=API_KEYS[1], max_retries=0)
    model_id = client.models.list().data[0].id
    out = client.completions.create(
        model=model_id, prompt="The quick brown fox", max_tokens=MAX_TOKENS, temperature=0
    )
    llm = LLM(model, num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    ref = llm.generate(["The quick brown fox"], greedy)[0]
    assert out.choices[0].text == ref.text


# -- internal services ---------------------------------------------------------------------
def test_internal_services_refuse_non_members(cluster, member, tmp_path):
    foreign = issue(tmp_path, "other")
    roles = {
        "master": nameservice_pb2.ROLE_MASTER,
        "cache": nameservice_pb2.ROLE_CACHE,
        "worker": nameservice_pb2.ROLE_FUSED,
    }
    assert_members_only(cluster.nameservice, "nameservice", member, foreign)
    for role, pb_role in roles.items():
        for m in _members(cluster, member, pb_role):
            assert_members_only(m.address, role, member, foreign)
    (frontend,) = _members(cluster, member, nameservice_pb2.ROLE_FRONTEND)
    _frontend_grpc_needs_certificate_and_key(frontend.address, member, foreign)


def _frontend_grpc_needs_certificate_and_key(address: str, member: TlsConfig, foreign) -> None:
    request = frontend_pb2.FrontendGenerateRequest(text="hi")
    request.params.max_tokens = 2

    async def generate(tls: TlsConfig, key: str | None) -> list:
        metadata = (("authorization", f"Bearer {key}"),) if key else None
        async with grpc_util.channel(address, tls) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            return [m async for m in stub.Generate(request, metadata=metadata, timeout=60)]

    for tls, key, code in (
        (foreign, API_KEYS[0], grpc.StatusCode.UNAVAILABLE),
        (member, None, grpc.StatusCode.UNAUTHENTICATED),
        (member, "sk-wrong", grpc.StatusCode.UNAUTHENTICATED),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            run_sync(generate(tls, key))
        assert err.value.code() == code
    assert run_sync(generate(member, API_KEYS[0]))[-1].finished


def test_nats_and_redis_need_their_secrets(cluster):
    async def nats_refuses() -> None:
        nc = nats_py.NATS()
        with pytest.raises(Exception):  # noqa: B017 - nats-py raises several kinds
            await nc.connect(cluster.info["nats"], allow_reconnect=False, max_reconnect_attempts=0)
        await nc.close()

    run_sync(nats_refuses())
    with pytest.raises(redis_py.exceptions.AuthenticationError):
        redis_py.Redis.from_url(cluster.info["redis"]).ping()
    assert redis_py.Redis.from_url(cluster.info["redis"], password=REDIS_PASSWORD).ping()
    for pid in cluster.pids():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert not [s for s in SECRETS if s.encode() in cmdline], pid


def test_each_service_gets_the_secrets_it_uses_by_environment(cluster):
    """docs/deployment/security.md's table, read from each process's own environment."""
    uses = {
        "nameservice": {"RTP_NATS_TOKEN"},
        "master": {"RTP_NATS_TOKEN"},
        "cache": {"RTP_NATS_TOKEN", "RTP_REDIS_PASSWORD"},
        "fused": {"RTP_NATS_TOKEN", "RTP_KV_INTEGRITY_KEY"},
        "frontend": {"RTP_API_KEYS", "RTP_METRICS_KEY", "RTP_ADMIN_KEY"},
    }
    secret_vars = set().union(*uses.values())
    for entry in cluster.info["pids"]:
        if entry["name"] not in uses:  # NATS and Redis read theirs from a config file
            continue
        environ = Path(f"/proc/{entry['pid']}/environ").read_bytes().split(b"\0")
        names = {kv.split(b"=", 1)[0].decode() for kv in environ if b"=" in kv}
        assert names & secret_vars == uses[entry["name"]], entry["name"]


def test_the_launchers_admin_key_lora_root_and_priority_floor_reach_the_frontend(cluster):
    """`up --admin-key --lora-root --priority-floor`: the LoRA admin endpoints take the admin
    key (not an API key) and only paths under the root; a priority below the floor is a 403."""
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        api = {"Authorization": f"Bearer {API_KEYS[0]}"}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        outside = {"lora_name": "x", "lora_path": "/etc"}
        assert http.post("/v1/load_lora_adapter", json=outside, headers=api).status_code == 401
        refused = http.post("/v1/load_lora_adapter", json=outside, headers=admin)
        assert refused.status_code == 403 and refused.json()["error"]["param"] == "lora_path"
        model = http.get("/v1/models", headers=api).json()["data"][0]["id"]
        body = {"model": model, "prompt": "hi", "max_tokens": 1}
        urgent = http.post(
            "/v1/completions", json={**body, "priority": PRIORITY_FLOOR - 1}, headers=api
        )
        assert urgent.status_code == 403 and urgent.json()["error"]["param"] == "priority"
        allowed = http.post(
            "/v1/completions", json={**body, "priority": PRIORITY_FLOOR}, headers=api
        )
        assert allowed.status_code == 200


# -- the cache instance on the authenticated bus -------------------------------------------
async def _generate(
    address: str, member: TlsConfig, prompt: list[int], rid: str
) -> list[worker_pb2.GenerateResponse]:
    """One greedy request straight to a worker, over TLS."""
    params = params_to_pb(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    async with grpc_util.channel(address, member) as ch:
        request = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params)
        return [m async for m in worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=60)]


def test_the_masters_index_follows_the_cache_over_the_token_bus(cluster, member, model):
    """The cache's memory (T2) reaches the master's prefix index by KV events on NATS, which
    needs the token: without it the index keeps the cache's part from when it joined."""
    (master,) = _members(cluster, member, nameservice_pb2.ROLE_MASTER)
    (cache,) = _members(cluster, member, nameservice_pb2.ROLE_CACHE)
    worker = _members(cluster, member, nameservice_pb2.ROLE_FUSED)[0]
    prompt = LLM(model, num_kv_blocks=64).tokenizer.encode("a prompt of several blocks, " * 12)
    for rid in ("index-a", "index-b"):  # its blocks are written back at their second use
        run_sync(_generate(worker.address, member, prompt, rid))

    async def state() -> tuple[set[bytes], set[bytes]]:
        async with grpc_util.channel(master.address, member) as ch:
            index = await master_pb2_grpc.MasterStub(ch).Index(master_pb2.IndexRequest(), timeout=5)
        async with grpc_util.channel(cache.address, member) as ch:
            snap = await cache_pb2_grpc.CacheStub(ch).Snapshot(
                worker_pb2.KVSnapshotRequest(), timeout=5
            )
        parts = {w.worker_id: set(w.block_hashes) for w in index.workers}
        return parts.get(cache.id, set()), set(snap.block_hashes)

    deadline = time.monotonic() + 20  # the worker writes back, the cache publishes: async
    while (got := run_sync(state()))[0] != got[1] or not got[1]:
        assert time.monotonic() < deadline, f"index {len(got[0])} != cache {len(got[1])} keys"
        time.sleep(0.1)


# -- a poisoned cache block ----------------------------------------------------------------
def _integrity_failures(metrics_address: str) -> float:
    text = httpx.get(f"http://{metrics_address}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "rtp:kv_integrity_failures":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return 0.0


def test_a_poisoned_cache_block_is_detected_counted_and_never_used(cluster, member, model):
    first, second = _members(cluster, member, nameservice_pb2.ROLE_FUSED)[:2]
    (cache,) = _members(cluster, member, nameservice_pb2.ROLE_CACHE)
    llm = LLM(model, num_kv_blocks=64)
    prompt = llm.tokenizer.encode("a prefix that someone poisons in the cache, " * 8)[:70]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    reference = llm.generate([prompt], greedy)[0].token_ids
    keys = block_hash_keys(prompt, 16, cache_salt(model, "float32"))[:4]

    async def poison() -> None:
        async with grpc_util.channel(cache.address, member) as ch:
            stub = cache_pb2_grpc.CacheStub(ch)
            deadline = time.monotonic() + 20
            while (
                await stub.Exists(cache_pb2.ExistsRequest(block_hashes=keys), timeout=5)
            ).num_prefix < 4:
                assert time.monotonic() < deadline, "the blocks never reached the cache service"
                await asyncio.sleep(0.05)
            blocks = list(
                (await stub.Get(cache_pb2.GetRequest(block_hashes=keys), timeout=5)).blocks
            )
            assert all(b.integrity for b in blocks)  # sealed by the worker that wrote them
            bad = blocks[2]
            bad.k = bytes(len(bad.k))  # zeroed keys: plausible shape, wrong content
            await stub.Put(cache_pb2.PutRequest(blocks=[bad]), timeout=5)
            again = (await stub.Get(cache_pb2.GetRequest(block_hashes=keys), timeout=5)).blocks
            assert again[2].k == bad.k  # the tier now serves the poisoned block

    async def run():
        computed = await _generate(first.address, member, prompt, "poison-a")
        await _generate(first.address, member, prompt, "poison-a2")  # reused: written back
        await poison()
        return computed, await _generate(second.address, member, prompt, "poison-b")

    before = _integrity_failures(second.metrics_address)
    computed, fetched = run_sync(run())
    assert computed[-1].num_cached_tokens == 0
    assert fetched[-1].num_cached_tokens == 32  # blocks 0-1 imported; 2 poisoned, 2-4 computed
    tokens = [[t for m in msgs for t in m.token_ids] for msgs in (computed, fetched)]
    assert tokens[0] == tokens[1] == reference
    assert _integrity_failures(second.metrics_address) == before + 1
