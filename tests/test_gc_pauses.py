"""The GC pause histogram times real collections, by generation."""

from __future__ import annotations

import gc

from prometheus_client import REGISTRY

from rtp_serve.services.common import gc_pauses


def _count(generation: str) -> float:
    value = REGISTRY.get_sample_value("rtp:gc_pause_seconds_count", {"generation": generation})
    return value or 0.0


def _sum(generation: str) -> float:
    return REGISTRY.get_sample_value("rtp:gc_pause_seconds_sum", {"generation": generation}) or 0.0


def test_each_collection_is_one_pause_of_its_generation():
    gc_pauses.watch()
    gc_pauses.watch()  # idempotent: one callback, so one observation per collection
    assert gc.callbacks.count(gc_pauses._callback) == 1
    gc.disable()  # only the collections asked for below
    try:
        full, young, total = _count("2"), _count("0"), _sum("2")
        junk = [[i] for i in range(200_000)]  # something for a full collection to walk
        gc.collect()
        gc.collect(0)
        assert (_count("2"), _count("0")) == (full + 1, young + 1)
        assert _sum("2") > total
        del junk
    finally:
        gc.enable()
