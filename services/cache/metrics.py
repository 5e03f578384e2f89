"""The cache service's metric families: Get lookups by tier (memory | redis), memory use."""

from __future__ import annotations

from collections.abc import Callable

from rtp_serve.services.common.metrics import (
    TIER_MEMORY,
    TIER_REDIS,
    Families,
    MetricSpec,
    default_families,
)


class CacheServiceMetrics(Families):
    SPECS = (
        MetricSpec(
            "hits", "counter", "cache_service_hits",
            "Blocks a Get answered from each tier.",
            ("tier",),
        ),
        MetricSpec(
            "misses", "counter", "cache_service_misses",
            "Blocks of a Get's prefix walk a tier lacked (memory: each block it had to ask "
            "Redis for, and the one that ended the walk; redis: the one that ended it).",
            ("tier",),
        ),
        MetricSpec(
            "memory_bytes", "gauge", "cache_memory_bytes",
            "Bytes of KV blocks in the memory tier.",
        ),
        MetricSpec("memory_blocks", "gauge", "cache_memory_blocks", "KV blocks in the memory tier."),
    )  # fmt: skip

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
    return default_families(CacheServiceMetrics)
