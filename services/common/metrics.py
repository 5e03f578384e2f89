"""Every Prometheus metric of rtp-serve: names, labels, buckets, and where they are served.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `rtp:time_to_first_token_seconds`)
so the dashboards the ecosystem already has carry over. A process registers, in
prometheus_client's default registry, only the families of the role it runs, on first use:

    frontend(model)      FrontendMetrics     per sequence: queue time, TTFT, ITL, e2e, finish
    http_middleware()                        HTTP responses by endpoint and status
    worker(role, model)  WorkerMetrics       load gauges, prefix-cache lookups, KV transfer
    master()             MasterMetrics       route decisions by policy and reason
    nameservice()        NameServiceMetrics  heartbeats, members by role, expirations
    cache_service()      CacheServiceMetrics Get lookups by tier (memory | redis), memory use

The frontend serves them at `GET /metrics` on its HTTP port (`handle_metrics`); every other
service on its own port (`start_metrics_server`, --metrics-port), and each registers that
address with the nameservice as `Member.metrics_address`.

Latency buckets span a millisecond to a couple of minutes: a CPU box in tests, GPUs in
production. Counters are exposed with the `_total` suffix (`rtp:request_success_total`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.exposition import choose_encoder

from services.common.pb import nameservice_pb2

if TYPE_CHECKING:
    from aiohttp import web

PREFIX = "rtp:"

# Label values (each label keeps a small, fixed vocabulary).
TIER_DEVICE, TIER_REMOTE = "device", "remote"  # worker prefix cache: own pool, cache service
TIER_MEMORY, TIER_REDIS = "memory", "redis"  # cache service: its LRU, the Redis tier
SENT, RECEIVED = "sent", "received"  # KV transfer direction (prefill sends, decode receives)
ABORT = "abort"  # finished_reason of a sequence that ended without finishing
CLIENT_CLOSED = "499"  # HTTP status label of a request whose client went away (nginx's)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# `*_created` series double the output and no dashboard reads them.
disable_created_metrics()


def role_label(role: int) -> str:
    """nameservice Role -> label value: ROLE_PREFILL -> "prefill"."""
    return nameservice_pb2.Role.Name(role).removeprefix("ROLE_").lower()


# -- frontend ------------------------------------------------------------------------------
class FrontendFamilies:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        m = ["model_name"]
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from a sequence's arrival to its first output token.",
            m,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive output tokens (one observation per token after the "
            "first; tokens arriving together share the gap).",
            m,
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from a sequence's arrival to its last token, for finished sequences.",
            m,
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time from a sequence's arrival until its worker stream is opened (routing).",
            m,
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Sequences that ended, by finished_reason (stop, length; abort: ended early).",
            [*m, "finished_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished sequences.", m, registry=registry
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens",
            "Output tokens of finished sequences.",
            m,
            registry=registry,
        )
        self.http_requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests by route and status (499: the client went away).",
            ["endpoint", "status"],
            registry=registry,
        )


@dataclass(slots=True)
class SequenceTimer:
    """The timeline of one sequence (one choice of a request) as the frontend sees it.

    arrival --started()--> worker stream open --tokens(n)...--> finished() | closed()
    |-- queue time ------|
    |-- time to first token ----------------------|-- ITL --|
    |-- e2e latency ------------------------------------------|
    """

    metrics: FrontendMetrics
    arrival: float = field(default_factory=time.monotonic)
    opened: bool = False
    last_token: float | None = None
    done: bool = False

    def started(self) -> None:
        """The worker stream is being opened (only the first attempt counts)."""
        if not self.opened:
            self.opened = True
            self.metrics.queue_time.observe(time.monotonic() - self.arrival)

    def tokens(self, n: int) -> None:
        """`n` output tokens arrived together."""
        if n <= 0:
            return
        now = time.monotonic()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.arrival)
            self.last_token, n = now, n - 1
        gap = (now - self.last_token) / n if n else 0.0
        for _ in range(n):
            self.metrics.itl.observe(gap)
        self.last_token = now

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.arrival)
        m.families.request_success.labels(m.model_name, reason).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion_tokens)

    def closed(self) -> None:
        """The sequence's stream ended; without finished() first, it counts as aborted."""
        if not self.done:
            self.done = True
            self.metrics.families.request_success.labels(self.metrics.model_name, ABORT).inc()


class FrontendMetrics:
    """The frontend's metrics for one served model."""

    __slots__ = (
        "families",
        "model_name",
        "ttft",
        "itl",
        "e2e",
        "queue_time",
        "prompt_tokens",
        "generation_tokens",
    )

    def __init__(self, families: FrontendFamilies, model_name: str) -> None:
        self.families = families
        self.model_name = model_name
        self.ttft = families.time_to_first_token.labels(model_name)
        self.itl = families.inter_token_latency.labels(model_name)
        self.e2e = families.e2e_request_latency.labels(model_name)
        self.queue_time = families.request_queue_time.labels(model_name)
        self.prompt_tokens = families.prompt_tokens.labels(model_name)
        self.generation_tokens = families.generation_tokens.labels(model_name)

    def sequence(self) -> SequenceTimer:
        """A timer for a sequence arriving now."""
        return SequenceTimer(self)


def frontend(model_name: str) -> FrontendMetrics:
    return FrontendMetrics(_default(FrontendFamilies), model_name)


def http_middleware() -> Any:
    """aiohttp middleware counting every response by route template and status. Put it
    outermost, so it sees the status that error-handling middlewares produce."""
    from aiohttp import web  # imported here: only the frontend serves HTTP

    counter = _default(FrontendFamilies).http_requests

    @web.middleware
    async def count_responses(request: web.Request, handler: Any) -> web.StreamResponse:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            counter.labels(endpoint, str(exc.status)).inc()
            raise
        except BaseException:  # cancelled: the client went away
            counter.labels(endpoint, CLIENT_CLOSED).inc()
            raise
        counter.labels(endpoint, str(response.status)).inc()
        return response

    return count_responses


async def handle_metrics(request: web.Request) -> web.Response:
    """`GET /metrics`: the process's metrics in the Prometheus text format (OpenMetrics
    when the scraper asks for it)."""
    from aiohttp import web

    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encode(REGISTRY), headers={"Content-Type": content_type})


# -- workers -------------------------------------------------------------------------------
class WorkerFamilies:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        w = ["role", "model_name"]
        self.num_requests_running = Gauge(
            PREFIX + "num_requests_running",
            "Requests in the worker's running batch.",
            w,
            registry=registry,
        )
        self.num_requests_waiting = Gauge(
            PREFIX + "num_requests_waiting",
            "Requests waiting to be scheduled on the worker.",
            w,
            registry=registry,
        )
        self.kv_cache_usage_perc = Gauge(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of the worker's KV blocks in use (1 = full; cached free blocks count "
            "as free).",
            w,
            registry=registry,
        )
        self.prefix_cache_queries = Counter(
            PREFIX + "prefix_cache_queries",
            "Prompt blocks looked up in a prefix-cache tier (device: the worker's pool; "
            "remote: the cache service, for the blocks the device lacked).",
            [*w, "tier"],
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            PREFIX + "prefix_cache_hits",
            "Prompt blocks found in a prefix-cache tier.",
            [*w, "tier"],
            registry=registry,
        )
        self.kv_transfer_bytes = Counter(
            PREFIX + "kv_transfer_bytes",
            "KV block bytes moved between prefill and decode workers (serialized KVBlock).",
            [*w, "direction"],
            registry=registry,
        )
        self.kv_transfer_blocks = Counter(
            PREFIX + "kv_transfer_blocks",
            "KV blocks moved between prefill and decode workers.",
            [*w, "direction"],
            registry=registry,
        )


class WorkerMetrics:
    """One worker's metrics: labels role and model_name fixed."""

    __slots__ = ("families", "role", "model_name", "running", "waiting", "usage")

    def __init__(self, families: WorkerFamilies, role: str, model_name: str) -> None:
        self.families = families
        self.role = role
        self.model_name = model_name
        self.running = families.num_requests_running.labels(role, model_name)
        self.waiting = families.num_requests_waiting.labels(role, model_name)
        self.usage = families.kv_cache_usage_perc.labels(role, model_name)

    def load(self, num_running: int, num_waiting: int, free_blocks: int, total_blocks: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.usage.set(1.0 - free_blocks / total_blocks if total_blocks else 0.0)

    def prefix_cache(
        self, queried: int, device_hits: int, remote_queried: int = 0, remote_hits: int = 0
    ) -> None:
        """One prompt's lookup, in blocks: the device tier first, then the remote tier for
        the blocks the device lacked."""
        f, labels = self.families, (self.role, self.model_name)
        f.prefix_cache_queries.labels(*labels, TIER_DEVICE).inc(queried)
        f.prefix_cache_hits.labels(*labels, TIER_DEVICE).inc(device_hits)
        if remote_queried:
            f.prefix_cache_queries.labels(*labels, TIER_REMOTE).inc(remote_queried)
            f.prefix_cache_hits.labels(*labels, TIER_REMOTE).inc(remote_hits)

    def kv_transfer(self, direction: str, nbytes: int, blocks: int = 1) -> None:
        labels = (self.role, self.model_name, direction)
        self.families.kv_transfer_bytes.labels(*labels).inc(nbytes)
        self.families.kv_transfer_blocks.labels(*labels).inc(blocks)


def worker(role: int, model: str) -> WorkerMetrics:
    """`model` is the model directory; its name is the model_name label (as the frontend's
    default served name)."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    return WorkerMetrics(_default(WorkerFamilies), role_label(role), name)


# -- master --------------------------------------------------------------------------------
class MasterMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.route_decisions = Counter(
            PREFIX + "route_decisions",
            "Route requests answered, by policy and reason (services.master.policy.RouteReason).",
            ["policy", "reason"],
            registry=registry,
        )

    def route(self, policy: str, reason: str) -> None:
        self.route_decisions.labels(policy, reason).inc()


def master() -> MasterMetrics:
    return _default(MasterMetrics)


# -- nameservice ---------------------------------------------------------------------------
class NameServiceMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.heartbeats = Counter(
            PREFIX + "heartbeats",
            "Heartbeats received (known=false: from a member already dropped, which must "
            "register again).",
            ["known"],
            registry=registry,
        )
        self.heartbeats_missed = Counter(
            PREFIX + "heartbeats_missed",
            "Members dropped because their heartbeats stopped for a whole TTL.",
            ["role"],
            registry=registry,
        )
        self.members = Gauge(
            PREFIX + "members", "Registered members by role.", ["role"], registry=registry
        )

    def heartbeat(self, known: bool) -> None:
        self.heartbeats.labels("true" if known else "false").inc()

    def membership(self, event: nameservice_pb2.MembershipEvent, expired: bool) -> None:
        """Account one broadcast membership change (`expired`: a LEFT for silence)."""
        role = role_label(event.member.role)
        if event.kind == nameservice_pb2.MembershipEvent.KIND_JOINED:
            self.members.labels(role).inc()
        elif event.kind == nameservice_pb2.MembershipEvent.KIND_LEFT:
            self.members.labels(role).dec()
            if expired:
                self.heartbeats_missed.labels(role).inc()


def nameservice() -> NameServiceMetrics:
    return _default(NameServiceMetrics)


# -- cache service -------------------------------------------------------------------------
class CacheServiceMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.hits = Counter(
            PREFIX + "cache_service_hits",
            "Blocks a Get answered from each tier.",
            ["tier"],
            registry=registry,
        )
        self.misses = Counter(
            PREFIX + "cache_service_misses",
            "Blocks of a Get's prefix walk a tier lacked (memory: each block it had to ask "
            "Redis for, and the one that ended the walk; redis: the one that ended it).",
            ["tier"],
            registry=registry,
        )
        self.memory_bytes = Gauge(
            PREFIX + "cache_memory_bytes",
            "Bytes of KV blocks in the memory tier.",
            registry=registry,
        )
        self.memory_blocks = Gauge(
            PREFIX + "cache_memory_blocks", "KV blocks in the memory tier.", registry=registry
        )

    def lookup(
        self, memory_hits: int, memory_misses: int, redis_hits: int = 0, redis_misses: int = 0
    ) -> None:
        self.hits.labels(TIER_MEMORY).inc(memory_hits)
        self.misses.labels(TIER_MEMORY).inc(memory_misses)
        if redis_hits or redis_misses:
            self.hits.labels(TIER_REDIS).inc(redis_hits)
            self.misses.labels(TIER_REDIS).inc(redis_misses)

    def watch_memory(self, used_bytes: Callable[[], float], blocks: Callable[[], float]) -> None:
        """Read the memory tier's size at each scrape."""
        self.memory_bytes.set_function(used_bytes)
        self.memory_blocks.set_function(blocks)


def cache_service() -> CacheServiceMetrics:
    return _default(CacheServiceMetrics)


# -- serving -------------------------------------------------------------------------------
def start_metrics_server(port: int = 0, host: str = "127.0.0.1") -> int:
    """Serve the default registry over HTTP on a daemon thread; returns the bound port
    (`port` 0: the OS picks a free one, bound at once, so no other process can take it)."""
    server, _ = start_http_server(port, addr=host)
    return server.server_port


T = TypeVar("T")
_families: dict[type, Any] = {}


def _default(cls: type[T]) -> T:
    """The process's one instance of a family set, registered in the default registry."""
    families = _families.get(cls)
    if families is None:
        families = _families[cls] = cls(REGISTRY)
    return families
