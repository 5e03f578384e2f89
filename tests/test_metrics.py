"""Prometheus metrics of a whole launched cluster (PD: 1 prefill, 1 decode).

Known traffic goes in (every sequence exactly MAX_TOKENS tokens, thanks to ignore_eos);
then every endpoint is scraped (the frontend's /metrics, each member's metrics_address from
the nameservice, and the nameservice's own from the launcher) and parsed with
prometheus_client's parser, and the counts and sums must agree with what was sent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from rtp_serve.core.block_hash import block_hash_keys
from rtp_serve.services.cache.lru import ByteLRU
from rtp_serve.services.cache.redis_tier import RedisTier
from rtp_serve.services.cache.servicer import CacheServicer
from rtp_serve.services.common.pb import common_pb2
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from rtp_serve.services.frontend import metrics
from tests import servers
from tests.cluster import Cluster, launch

MAX_TOKENS = 8
BLOCK = 16  # the launcher's default block size
LONG = "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n" * 4
COMPLETIONS = ["def fibonacci(n):\n    ", "The quick brown fox", LONG, LONG]  # LONG twice: a hit
STREAMED = ["for i in range(10):\n    print(i)\n", "SELECT id FROM users"]
CHAT = [{"role": "user", "content": "Sort a list."}]
ROUTE_REASONS = {"prefix_hit", "least_loaded", "round_robin", "affinity", "no_workers"}


@dataclass
class Sent:
    """What the traffic was, as the clients saw it: one entry per sequence."""

    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    wall_s: float = 0.0  # the whole traffic, sequential, end to end

    def add(self, usage, finish_reason: str) -> None:
        self.prompt_tokens.append(usage.prompt_tokens)
        self.completion_tokens.append(usage.completion_tokens)
        details = usage.prompt_tokens_details
        self.cached_tokens.append(details.cached_tokens if details else 0)
        self.finish_reasons.append(finish_reason)

    @property
    def n(self) -> int:
        return len(self.prompt_tokens)

    def usable_blocks(self) -> list[int]:
        """Prompt blocks a worker looks up (at least one prompt token is always computed)."""
        return [(p - 1) // BLOCK for p in self.prompt_tokens]


# -- units: what one observation means ------------------------------------------------------
def test_sequence_timer_counts_each_token_once():
    registry = CollectorRegistry()
    m = metrics.FrontendMetrics(metrics.FrontendFamilies(registry), "m")
    timer = m.sequence(7)
    timer.started()
    timer.started()  # a retry opens another stream: still one queue time
    for n in (1, 0, 3, 1):  # the first token alone, then a batch of three, then one
        timer.tokens(n)
    timer.finished("length", prompt_tokens=7, completion_tokens=5)
    timer.closed()
    aborted = m.sequence(3)
    aborted.closed()

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("rtp:request_queue_time_seconds_count") == 1
    assert value("rtp:time_to_first_token_seconds_count") == 1
    assert value("rtp:inter_token_latency_seconds_count") == 4
    assert value("rtp:e2e_request_latency_seconds_count") == 1
    assert value("rtp:request_success_total", finished_reason="length") == 1
    assert value("rtp:request_success_total", finished_reason="abort") == 1
    assert value("rtp:generation_tokens_total") == 5
    assert value("rtp:prompt_tokens_total") == 7  # of the finished
    assert value("rtp:requests_received_total") == 2
    assert value("rtp:prompt_tokens_received_total") == 10  # of every arrival, on arrival


def test_prediction_errors_signed_and_absolute(monkeypatch):
    """Two predicted sequences, one 0.2 s slower and one 0.1 s faster than predicted, one
    unpredicted: the signed histogram splits them at 0 (and, having negative buckets,
    exports no _sum), the absolute one sums to 0.3 s."""
    registry = CollectorRegistry()
    m = metrics.FrontendMetrics(metrics.FrontendFamilies(registry), "m")
    now = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    for predicted, took in ((0.5, 0.7), (0.5, 0.4), (0.0, 0.3)):
        timer = m.sequence(1)
        timer.routed(predicted)
        now[0] += took
        timer.tokens(1)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("rtp:ttft_prediction_error_seconds_count") == 2
    assert value("rtp:ttft_prediction_error_seconds_bucket", le="0.0") == 1
    assert value("rtp:ttft_prediction_error_seconds_sum") is None
    assert value("rtp:ttft_prediction_abs_error_seconds_count") == 2
    assert value("rtp:ttft_prediction_abs_error_seconds_sum") == pytest.approx(0.3)


def test_cache_service_counts_a_get_per_tier(tmp_path):
    """memory holds b0 b1, Redis holds b2 (and b4), nobody b3: Get(b0..b4) answers b0 b1 b2."""
    hashes = block_hash_keys(list(range(5 * 16)), 16, salt=b"metrics")
    blocks = [common_pb2.KVBlock(block_hash=h, index=i, k=bytes(64)) for i, h in enumerate(hashes)]
    value = {b.block_hash: b.SerializeToString() for b in blocks}

    def counts() -> list[float]:
        return [
            REGISTRY.get_sample_value(f"rtp:cache_service_{kind}_total", {"tier": tier}) or 0.0
            for kind in ("hits", "misses")
            for tier in ("memory", "redis")
        ]

    async def main(url: str) -> list[common_pb2.KVBlock]:
        tier = RedisTier(url, "metrics")
        servicer = CacheServicer(ByteLRU(1 << 20), tier)
        try:
            assert await tier.put_many([(h, value[h]) for h in (hashes[2], hashes[4])])
            for h in hashes[:2]:
                servicer.lru.put(h, value[h])
            return await servicer.get_prefix(hashes)
        finally:
            await servicer.close()
            await tier.close()

    before = counts()
    with servers.redis(tmp_path) as redis:
        found = asyncio.run(asyncio.wait_for(main(redis.url), 20))
    assert [b.index for b in found] == [0, 1, 2]
    delta = [after - b for after, b in zip(counts(), before, strict=True)]
    # hits: memory b0 b1, redis b2; misses: memory b2 b3, redis b3 (the walk ends there)
    assert delta == [2, 1, 2, 1]


# -- the cluster ---------------------------------------------------------------------------
def scrape(address: str) -> list[Sample]:
    reply = httpx.get(f"http://{address}/metrics", timeout=10)
    reply.raise_for_status()
    return [s for f in text_string_to_metric_families(reply.text) for s in f.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def names(samples: list[Sample]) -> set[str]:
    return {s.name for s in samples}


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    model = str(model_dir("tiny-llama"))
    with launch(model, tmp_path_factory.mktemp("metrics"), "--prefill", "1", "--decode", "1") as c:
        yield c
    assert c.left_running == [], "stopping the launcher left processes running"


@pytest.fixture(scope="module")
def sent(cluster: Cluster) -> Sent:
    # The prefill worker finds the cache service through the nameservice: let it register,
    # so every request's remote lookup really reaches it.
    deadline = time.monotonic() + 10
    while not cluster.members(ns_pb2.ROLE_CACHE) and time.monotonic() < deadline:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="-", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    fixed = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    out = Sent()
    start = time.monotonic()
    for i, prompt in enumerate(COMPLETIONS):
        if prompt in COMPLETIONS[:i]:
            _wait_for_index(cluster, blocks=max(out.usable_blocks()))
        reply = client.completions.create(model=model, prompt=prompt, **fixed)
        out.add(reply.usage, reply.choices[0].finish_reason)
    for prompt in STREAMED:
        chunks = list(
            client.completions.create(
                model=model,
                prompt=prompt,
                stream=True,
                stream_options={"include_usage": True},
                **fixed,
            )
        )
        reason = next(
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        )
        out.add(chunks[-1].usage, reason)
    reply = client.chat.completions.create(model=model, messages=CHAT, **fixed)
    out.add(reply.usage, reply.choices[0].finish_reason)
    out.wall_s = time.monotonic() - start
    # Refused before routing: counted by HTTP status only.
    bad = httpx.post(
        cluster.url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 0}
    )
    assert bad.status_code == 400
    cluster.wait_idle()
    return out


def _wait_for_index(cluster: Cluster, blocks: int) -> None:
    """Until the master's index holds `blocks` of the prefill worker's: its KV events travel
    over NATS, so a repeated prompt sent at once may be routed before they arrive."""
    master = _member(cluster, ns_pb2.ROLE_MASTER).metrics_address
    worker = _member(cluster, ns_pb2.ROLE_PREFILL).id
    deadline = time.monotonic() + 10
    while total(scrape(master), "rtp:index_blocks", worker=worker) < blocks:
        assert time.monotonic() < deadline, f"the master's index never held {blocks} blocks"
        time.sleep(0.02)


def _member(cluster: Cluster, role: int) -> ns_pb2.Member:
    (member,) = cluster.members(role)
    return member


def test_every_member_serves_metrics(cluster, sent):
    members = cluster.members()
    assert {m.role for m in members} >= {
        ns_pb2.ROLE_FRONTEND,
        ns_pb2.ROLE_MASTER,
        ns_pb2.ROLE_CACHE,
        ns_pb2.ROLE_PREFILL,
        ns_pb2.ROLE_DECODE,
    }
    addresses = {m.metrics_address for m in members}
    assert "" not in addresses and len(addresses) == len(members)
    # Each process exposes the metrics of its own role, and no other role's.
    markers = {
        ns_pb2.ROLE_FRONTEND: "rtp:time_to_first_token_seconds_count",
        ns_pb2.ROLE_MASTER: "rtp:route_decisions_total",
        ns_pb2.ROLE_CACHE: "rtp:cache_memory_blocks",
        ns_pb2.ROLE_PREFILL: "rtp:num_requests_running",
        ns_pb2.ROLE_DECODE: "rtp:num_requests_running",
    }
    for m in members:
        exposed = names(scrape(m.metrics_address))
        assert exposed & set(markers.values()) == {markers[m.role]}, m
        assert "rtp:gc_pause_seconds_count" in exposed, m  # every process: its GC pauses
    ns = names(scrape(cluster.info["nameservice_metrics"]))
    assert "rtp:heartbeats_total" in ns and not ns & set(markers.values())
    assert "rtp:gc_pause_seconds_count" in ns
    frontend = _member(cluster, ns_pb2.ROLE_FRONTEND)
    assert frontend.metrics_address == cluster.url.removeprefix("http://")


def test_frontend_latencies_and_counts(cluster, sent):
    s = scrape(_member(cluster, ns_pb2.ROLE_FRONTEND).metrics_address)
    n, tokens = sent.n, sum(sent.completion_tokens)
    assert tokens == n * MAX_TOKENS
    assert total(s, "rtp:e2e_request_latency_seconds_count") == n
    assert total(s, "rtp:time_to_first_token_seconds_count") == n
    assert total(s, "rtp:request_queue_time_seconds_count") == n
    assert total(s, "rtp:inter_token_latency_seconds_count") == tokens - n
    # Per sequence: queue <= ttft, and ttft + its token gaps = the last token <= e2e; the
    # requests ran one after another, so all of it fits in the traffic's wall time.
    queue, ttft = (
        total(s, "rtp:request_queue_time_seconds_sum"),
        total(s, "rtp:time_to_first_token_seconds_sum"),
    )
    itl, e2e = (
        total(s, "rtp:inter_token_latency_seconds_sum"),
        total(s, "rtp:e2e_request_latency_seconds_sum"),
    )
    assert 0 < queue <= ttft
    assert itl > 0
    # The worker's queue and compute shares of each first token (bench/hops.py splits TTFT
    # by them) fall between the stream opening and the token's arrival.
    worker = [total(s, f"rtp:ttft_worker_{hop}_seconds_sum") for hop in ("queue", "prefill")]
    assert total(s, "rtp:ttft_worker_prefill_seconds_count") == n
    assert total(s, "rtp:ttft_worker_queue_seconds_count") == n
    assert worker[1] > 0 and min(worker) >= 0
    assert sum(worker) <= ttft - queue + 1e-6 * n
    assert ttft + itl <= e2e + 1e-6 * n
    assert e2e <= sent.wall_s
    model = {"model_name": _member(cluster, ns_pb2.ROLE_FRONTEND).model}
    assert total(s, "rtp:e2e_request_latency_seconds_bucket", le="+Inf", **model) == n
    for reason in set(sent.finish_reasons):
        expected = sent.finish_reasons.count(reason)
        assert total(s, "rtp:request_success_total", finished_reason=reason) == expected
    assert total(s, "rtp:request_success_total") == n
    assert total(s, "rtp:generation_tokens_total") == tokens
    assert total(s, "rtp:prompt_tokens_total") == sum(sent.prompt_tokens)
    http = "rtp:http_requests_total"
    completions = len(COMPLETIONS) + len(STREAMED)
    assert total(s, http, endpoint="/v1/completions", status="200") == completions
    assert total(s, http, endpoint="/v1/chat/completions", status="200") == 1
    assert total(s, http, endpoint="/v1/completions", status="400") == 1


def test_worker_prefix_cache_and_kv_transfer(cluster, sent):
    prefill = scrape(_member(cluster, ns_pb2.ROLE_PREFILL).metrics_address)
    decode = scrape(_member(cluster, ns_pb2.ROLE_DECODE).metrics_address)
    usable = sent.usable_blocks()
    cached = [c // BLOCK for c in sent.cached_tokens]
    queries, hits = "rtp:prefix_cache_queries_total", "rtp:prefix_cache_hits_total"
    assert total(prefill, queries, tier="device", role="prefill") == sum(usable)
    assert total(prefill, hits) == sum(cached) > 0  # the repeated LONG prompt
    assert total(prefill, hits, tier="remote") == 0  # one prefill worker: the device has all
    missed = [u - c for u, c in zip(usable, cached, strict=True)]
    # No lookup asked the remote tier: each route said it holds no more of the prompt than
    # the prefill worker (RoutePlan.remote_blocks), and each skip is counted.
    gets = sum(1 for m in missed if m > 0)
    assert total(prefill, queries, tier="remote") == 0
    assert total(prefill, "rtp:remote_lookups_skipped_total") == gets > 0
    # Prefill computed the prompt; decode only received its KV.
    assert total(decode, queries) == 0
    sent_bytes = total(prefill, "rtp:kv_transfer_bytes_total", direction="sent")
    assert sent_bytes > 0
    assert total(decode, "rtp:kv_transfer_bytes_total", direction="received") == sent_bytes
    assert total(decode, "rtp:kv_transfer_blocks_total", direction="received") == total(
        prefill, "rtp:kv_transfer_blocks_total", direction="sent"
    )
    # The remote tier's view of the same lookups: none reached it.
    cache = scrape(_member(cluster, ns_pb2.ROLE_CACHE).metrics_address)
    assert total(cache, "rtp:cache_service_hits_total") == 0
    assert total(cache, "rtp:cache_service_misses_total") == 0


def test_worker_load_gauges(cluster, sent):
    for role in (ns_pb2.ROLE_PREFILL, ns_pb2.ROLE_DECODE):
        address = _member(cluster, role).metrics_address
        deadline = time.monotonic() + 5  # the gauges follow the engine every 0.25 s
        while True:
            s = scrape(address)
            busy = total(s, "rtp:num_requests_running") + total(s, "rtp:num_requests_waiting")
            if busy == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert busy == 0, (role, busy)
        (usage,) = [x for x in s if x.name == "rtp:kv_cache_usage_perc"]
        assert 0.0 <= usage.value <= 1.0
        assert usage.labels["role"] == ns_pb2.Role.Name(role).removeprefix("ROLE_").lower()


def test_master_route_decisions(cluster, sent):
    s = scrape(_member(cluster, ns_pb2.ROLE_MASTER).metrics_address)
    decisions = [x for x in s if x.name == "rtp:route_decisions_total"]
    assert sum(x.value for x in decisions) == sent.n
    assert {x.labels["policy"] for x in decisions} == {"cache_aware"}
    assert {x.labels["reason"] for x in decisions} <= ROUTE_REASONS
    assert total(s, "rtp:route_decisions_total", reason="prefix_hit") >= 1  # LONG again


def test_nameservice_heartbeats_and_members(cluster, sent):
    s = scrape(cluster.info["nameservice_metrics"])
    assert total(s, "rtp:heartbeats_total", known="true") > 0
    assert total(s, "rtp:heartbeats_missed_total") == 0
    for role in (ns_pb2.ROLE_FRONTEND, ns_pb2.ROLE_MASTER, ns_pb2.ROLE_PREFILL):
        label = ns_pb2.Role.Name(role).removeprefix("ROLE_").lower()
        assert total(s, "rtp:members", role=label) == len(cluster.members(role))
    assert total(s, "rtp:members") == len(cluster.members())
