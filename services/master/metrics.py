"""The master's metric families: route decisions by policy and reason."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from services.common.metrics import PREFIX, default_families


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
    return default_families(MasterMetrics)
