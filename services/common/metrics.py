"""What every service's Prometheus metrics share: names, label values, buckets, and where
they are served. Each role defines its own families beside its service:

    services/frontend/metrics.py     per sequence: queue time, TTFT, ITL, e2e, finish; HTTP
    services/worker/metrics.py       load gauges, prefix-cache lookups, KV transfer
    services/master/metrics.py       route decisions by policy and reason
    services/nameservice/metrics.py  heartbeats, members by role, expirations
    services/cache/metrics.py        Get lookups by tier (memory | redis), memory use

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `rtp:time_to_first_token_seconds`)
so the dashboards the ecosystem already has carry over. A process registers, in
prometheus_client's default registry, only the families of the role it runs, on first use
(`default_families`).

The frontend serves them at `GET /metrics` on its HTTP port (`handle_metrics`); every other
service on its own port (`start_metrics_server`, --metrics-port), and each registers that
address with the nameservice as `Member.metrics_address`.

Each role declares its families as a table of `MetricSpec`s on a `Families` subclass, which
builds them into a registry as the attributes the specs name; the class adds only what is
its own (label helpers, scrape-time readers).

Latency buckets span a millisecond to a couple of minutes: a CPU box in tests, GPUs in
production. Counters are exposed with the `_total` suffix (`rtp:request_success_total`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

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

from rtp_serve.core.cost_model import TIER_HOST as TIER_HOST
from rtp_serve.core.cost_model import TIER_REMOTE as TIER_REMOTE
from rtp_serve.services.common.pb import nameservice_pb2

if TYPE_CHECKING:
    from aiohttp import web

PREFIX = "rtp:"

# Label values (each label keeps a small, fixed vocabulary).
# worker prefix cache: own pool, its host-memory tier below it, the cache service
TIER_DEVICE = "device"
TIER_MEMORY, TIER_REDIS = "memory", "redis"  # cache service: its LRU, the Redis tier
SENT, RECEIVED = "sent", "received"  # KV transfer direction (prefill sends, decode receives)
ABORT = "abort"  # finished_reason of a sequence that ended without finishing
CLIENT_CLOSED = "499"  # HTTP status label of a request whose client went away (nginx's)

# actual - predicted seconds (the master's TTFT prediction), either side of 0
PREDICTION_ERROR_BUCKETS = (
    -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0.0,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# `*_created` series double the output and no dashboard reads them.
disable_created_metrics()


Kind = Literal["counter", "gauge", "histogram"]
Metric = Counter | Gauge | Histogram


@dataclass(slots=True, frozen=True)
class MetricSpec:
    """One family: the attribute it is reached by, and what Prometheus is told of it."""

    attr: str
    kind: Kind
    name: str  # without PREFIX
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only

    def build(self, registry: CollectorRegistry) -> Metric:
        name = PREFIX + self.name
        if self.kind == "counter":
            return Counter(name, self.help, self.labels, registry=registry)
        if self.kind == "gauge":
            return Gauge(name, self.help, self.labels, registry=registry)
        if self.buckets is None:
            raise ValueError(f"histogram {name} needs buckets")
        return Histogram(name, self.help, self.labels, buckets=self.buckets, registry=registry)


class Families:
    """A role's families, built from `SPECS` (in order) into `registry`, each set as the
    attribute its spec names."""

    SPECS: ClassVar[tuple[MetricSpec, ...]] = ()

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        for spec in self.SPECS:
            if hasattr(self, spec.attr):  # a spec must not shadow a method or another spec
                raise ValueError(f"{type(self).__name__}.{spec.attr} is already defined")
            setattr(self, spec.attr, spec.build(registry))

    if TYPE_CHECKING:
        # The attributes come from SPECS at run time; a type checker cannot see them.
        def __getattr__(self, name: str) -> Any: ...


def role_label(role: int) -> str:
    """nameservice Role -> label value: ROLE_PREFILL -> "prefill"."""
    return nameservice_pb2.Role.Name(role).removeprefix("ROLE_").lower()


async def handle_metrics(request: web.Request) -> web.Response:
    """`GET /metrics`: the process's metrics in the Prometheus text format (OpenMetrics
    when the scraper asks for it)."""
    from aiohttp import web

    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encode(REGISTRY), headers={"Content-Type": content_type})


def start_metrics_server(port: int = 0, host: str = "127.0.0.1") -> int:
    """Serve the default registry over HTTP on a daemon thread; returns the bound port
    (`port` 0: the OS picks a free one, bound at once, so no other process can take it)."""
    server, _ = start_http_server(port, addr=host)
    return server.server_port


T = TypeVar("T")
_families: dict[type, Any] = {}


def default_families(cls: type[T]) -> T:
    """The process's one instance of a family set, registered in the default registry."""
    families = _families.get(cls)
    if families is None:
        families = _families[cls] = cls(REGISTRY)
    return families
