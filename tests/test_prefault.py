"""Mapping the KV pool ahead of use (engine/prefault.py): every page of a fresh pool mapped,
nothing written over what blocks in use already hold."""

from __future__ import annotations

import argparse
import threading

import pytest
import torch

from rtp_serve.engine import prefault
from rtp_serve.engine.config import EngineConfig
from rtp_serve.engine.llm_engine import LLMEngine
from rtp_serve.services.worker.config import add_worker_arguments, engine_config


def _rss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Rss:"))


def test_the_rounds_cover_every_layer_and_slot_once_in_block_order():
    pool = torch.empty(3, 2, 5000, 4, 64)
    seen: list[tuple[int, int]] = []
    firsts = []
    for round_ in prefault.stretches(pool):
        assert len(round_) == 6  # every layer's K and V
        firsts.append(round_[0][0])
        seen.extend(round_)
    assert firsts == sorted(firsts)  # lowest slots first, as the block pool hands them out
    seen.sort()
    assert sum(n for _, n in seen) == pool.nbytes
    for (a, n), (b, _) in zip(seen, seen[1:], strict=False):
        assert a + n <= b


def test_fault_in_maps_a_fresh_pool_and_keeps_what_blocks_hold():
    pool = torch.empty(2, 2, 64 * 1024, 4, 64)  # 256 MiB: its own fresh mapping
    pool[1, 0, 100:116] = 7.0  # a block in use before the pool is mapped
    before = _rss_bytes()
    done = prefault.fault_in(pool)
    grown = _rss_bytes() - before
    assert done > 0.99 * pool.nbytes - (1 << 20)
    assert grown > 0.9 * pool.nbytes
    assert torch.equal(pool[1, 0, 100:116], torch.full((16, 4, 64), 7.0))
    assert pool[0].abs().sum() == 0 and pool[1, 1].abs().sum() == 0


def _resident(address: int) -> int:
    """Resident bytes of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) << 10
    raise AssertionError(f"no mapping holds {address:#x}")


def test_an_engine_asked_to_maps_its_pool_in_the_background(model_dir):
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir("tiny-llama")), kv_cache_memory_bytes=96 << 20, prefault_kv=True
        )
    )
    pool = engine.runner.kv_cache
    for thread in threading.enumerate():
        if thread.name == "kv-prefault":
            thread.join(timeout=60)
    assert _resident(pool.data_ptr()) > 0.95 * pool.nbytes


def test_a_stopped_thread_maps_no_more():
    pool = torch.empty(1, 2, 256 * 1024, 4, 64)  # 512 MiB
    stop = threading.Event()
    stop.set()
    assert prefault.fault_in(pool, stop) == 0


def test_workers_map_ahead_when_asked_by_flag_or_environment(model_dir, monkeypatch):
    """--prefault-kv / RTP_PREFAULT_KV reach the engine's config; a value that is neither
    yes nor no is refused by name."""

    def config(*flags: str):
        p = argparse.ArgumentParser()
        add_worker_arguments(p)
        tiny = str(model_dir("tiny-llama"))
        return engine_config(p.parse_args(["--model", tiny, "--kv-cache-mib", "64", *flags]))

    assert not config().prefault_kv
    assert config("--prefault-kv").prefault_kv
    monkeypatch.setenv("RTP_PREFAULT_KV", "yes")
    assert config().prefault_kv
    assert not config("--no-prefault-kv").prefault_kv
    monkeypatch.setenv("RTP_PREFAULT_KV", "maybe")
    with pytest.raises(ValueError, match="RTP_PREFAULT_KV='maybe'"):
        config()
