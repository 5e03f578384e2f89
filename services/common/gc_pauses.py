"""The garbage collector's pauses as a Prometheus histogram, `rtp:gc_pause_seconds`, by
generation: a collection stops the thread that triggered it (on an asyncio service, the
loop), so a route or a token that waits behind one shows it in its own latency, and
prometheus_client's `python_gc_collections_total` counts collections but not their time.

`watch()` is called once per process by `lifecycle.run_service`.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from rtp_serve.services.common.metrics import Families, MetricSpec, default_families

GC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class GcMetrics(Families):
    SPECS = (
        MetricSpec(
            "pause", "histogram", "gc_pause_seconds",
            "Seconds each garbage collection held the thread that ran it, by generation "
            "(2: a full collection, which walks every tracked object).",
            ("generation",), GC_BUCKETS,
        ),
    )  # fmt: skip


_started: list[float] = []


def _callback(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:
        pause = time.perf_counter() - _started.pop()
        default_families(GcMetrics).pause.labels(str(info["generation"])).observe(pause)


def watch() -> None:
    """Time every collection in this process from now on (idempotent)."""
    if _callback not in gc.callbacks:
        default_families(GcMetrics)  # registered before the first scrape, at zero
        gc.callbacks.append(_callback)
