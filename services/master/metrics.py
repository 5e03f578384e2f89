"""The master's metric families: route decisions by policy and reason; prefix-index
resyncs by reason, and the index's size per worker (read from the view at scrape time)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rtp_serve.services.common.metrics import PREFIX, Families, MetricSpec, default_families

# Route decisions take tens of microseconds to milliseconds; event lag, milliseconds up.
# Finer from 1 to 10 ms, where the p99 goal (2 ms) lies.
ROUTE_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01,
    0.02, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
BATCH_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256, 1024)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class MasterMetrics(Families):
    SPECS = (
        MetricSpec(
            "route_duration", "histogram", "route_duration_seconds",
            "Seconds the master took to answer a Route call (server side, from its arrival "
            "at the servicer to the plan; each route of a RouteBatch counts alone).",
            (), ROUTE_BUCKETS,
        ),
        MetricSpec(
            "route_cpu", "histogram", "route_cpu_seconds",
            "CPU seconds the master's thread spent on a Route call over the same span as "
            "route_duration_seconds: the difference is time spent waiting for a core or "
            "for the GIL.",
            (), ROUTE_BUCKETS,
        ),
        MetricSpec(
            "route_batch_size", "histogram", "route_batch_size",
            "Routes per RouteBatch call (a frontend sends the routes that arrived while its "
            "last call was in flight together; a lone route is a plain Route call).",
            (), BATCH_BUCKETS,
        ),
        MetricSpec(
            "index_event_blocks", "counter", "index_event_blocks",
            "Block hashes received in workers' KV event batches (stored and removed, both "
            "tiers), whether applied or buffered for a resync.",
        ),
        MetricSpec(
            "index_event_lag", "histogram", "index_event_lag_seconds",
            "Seconds from a worker publishing a KV event batch to the master taking it "
            "(across machines this includes their clock offset).",
            (), LAG_BUCKETS,
        ),
        MetricSpec(
            "route_decisions", "counter", "route_decisions",
            "Route requests answered, by policy and reason (services.master.policy.RouteReason).",
            ("policy", "reason"),
        ),
        MetricSpec(
            "index_resyncs", "counter", "index_resyncs",
            "Workers' prefix-index parts rebuilt from their snapshot, by reason "
            "(services.master.index_sync.ResyncReason).",
            ("reason",),
        ),
        MetricSpec(
            "index_resync_failures", "counter", "index_resync_failures",
            "Snapshot fetches that failed or were refused (retried with backoff).",
        ),
        MetricSpec(
            "integrity_failures", "counter", "integrity_failures",
            "Idle-time integrity checks of the cluster view that failed (each resyncs the "
            "whole index).",
        ),
        MetricSpec(
            "charges_shared", "counter", "shared_charges",
            "Route charges received from other master replicas and applied here "
            "(services.master.charge_exchange).",
        ),
    )  # fmt: skip

    def shared_charges(self, n: int) -> None:
        self.charges_shared.inc(n)

    def route(self, policy: str, reason: str) -> None:
        self.route_decisions.labels(policy, reason).inc()

    def route_batch(self, n: int) -> None:
        self.route_batch_size.observe(n)

    def routed_in(self, seconds: float, cpu_seconds: float) -> None:
        self.route_duration.observe(seconds)
        self.route_cpu.observe(cpu_seconds)

    def kv_events(self, blocks: int, published_unix_ns: int) -> None:
        """A KV event batch arrived: its size, and its lag if the worker stamped it."""
        self.index_event_blocks.inc(blocks)
        if published_unix_ns:
            self.index_event_lag.observe(max(0.0, (time.time_ns() - published_unix_ns) / 1e9))

    def resynced(self, reason: str) -> None:
        self.index_resyncs.labels(reason).inc()

    def resync_failed(self) -> None:
        self.index_resync_failures.inc()

    def integrity_failed(self) -> None:
        self.integrity_failures.inc()


class IndexSizeCollector(Collector):
    """`rtp:index_blocks{worker}`: block hashes the index holds per worker, read at scrape
    time from `sizes()` (so departed workers disappear with their entries).

    The metrics server answers on a thread of its own, and the index belongs to `loop`
    (reading it applies the batches it holds back): `sizes()` runs on that loop, and the
    scrape waits for it up to `timeout_s`, then answers with the last sizes read. Called
    on the loop itself, it reads at once."""

    def __init__(
        self,
        sizes: Callable[[], dict[str, int]],
        loop: asyncio.AbstractEventLoop,
        timeout_s: float = 5.0,
    ) -> None:
        self._sizes, self._loop, self._timeout_s = sizes, loop, timeout_s
        self._last: dict[str, int] = {}

    def _read(self) -> dict[str, int]:
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is self._loop:
                return self._sizes()
        answer: concurrent.futures.Future[dict[str, int]] = concurrent.futures.Future()

        def read() -> None:
            try:
                answer.set_result(self._sizes())
            except BaseException as exc:  # handed to the scraping thread
                answer.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(read)
            return answer.result(self._timeout_s)
        except (RuntimeError, TimeoutError):  # the loop is closed, or too busy to answer
            return self._last

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self._last = sizes = self._read()
        family = GaugeMetricFamily(
            PREFIX + "index_blocks",
            "Block hashes in the master's prefix index, by worker.",
            labels=["worker"],
        )
        for worker_id, n in sorted(sizes.items()):
            family.add_metric([worker_id], n)
        yield family


def master() -> MasterMetrics:
    return default_families(MasterMetrics)
