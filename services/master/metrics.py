"""The master's metric families: route decisions by policy and reason; prefix-index
resyncs by reason, and the index's size per worker (read from the view at scrape time)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rtp_serve.services.common.metrics import PREFIX, Families, MetricSpec, default_families


class MasterMetrics(Families):
    SPECS = (
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
    )  # fmt: skip

    def route(self, policy: str, reason: str) -> None:
        self.route_decisions.labels(policy, reason).inc()

    def resynced(self, reason: str) -> None:
        self.index_resyncs.labels(reason).inc()

    def resync_failed(self) -> None:
        self.index_resync_failures.inc()

    def integrity_failed(self) -> None:
        self.integrity_failures.inc()


class IndexSizeCollector(Collector):
    """`rtp:index_blocks{worker}`: block hashes the index holds per worker, read at scrape
    time from `sizes()` (so departed workers disappear with their entries)."""

    def __init__(self, sizes: Callable[[], dict[str, int]]) -> None:
        self._sizes = sizes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            PREFIX + "index_blocks",
            "Block hashes in the master's prefix index, by worker.",
            labels=["worker"],
        )
        for worker_id, n in sorted(self._sizes().items()):
            family.add_metric([worker_id], n)
        yield family


def master() -> MasterMetrics:
    return default_families(MasterMetrics)
