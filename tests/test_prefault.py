"""Mapping the KV pool ahead of use (engine/prefault.py): every page of a fresh pool mapped,
nothing written over what blocks in use already hold."""

from __future__ import annotations

import argparse
import ctypes
import logging
import math
import mmap
import os
import threading

import pytest
import torch

from rtp_serve.engine import prefault
from rtp_serve.engine.async_llm import AsyncLLM
from rtp_serve.engine.config import EngineConfig
from rtp_serve.engine.llm_engine import LLMEngine
from rtp_serve.services.worker.config import add_worker_arguments, engine_config


def _resident(t: torch.Tensor) -> int:
    """Bytes of the pages wholly inside `t` that are mapped now (mincore over its range:
    only this tensor's pages, whatever the rest of the process allocates or frees)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    first = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.nbytes) // page * page
    vec = ctypes.create_string_buffer((end - first) // page)
    assert libc.mincore(first, end - first, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw) * page


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


def _fresh_pool(*shape: int) -> torch.Tensor:
    """A float32 tensor on an anonymous mapping of its own, none of its pages touched (what
    torch.empty gives a pool of 64 MiB or more, unless malloc's heap has that much free
    already: a process that keeps freed memory, services/common/heap.py, may)."""
    nbytes = 4 * math.prod(shape)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.float32).view(shape)


def test_fault_in_maps_a_fresh_pool_and_keeps_what_blocks_hold():
    pool = _fresh_pool(2, 2, 64 * 1024, 4, 64)  # 256 MiB
    pool[1, 0, 100:116] = 7.0  # a block in use before the pool is mapped
    assert _resident(pool) < pool.nbytes / 100
    done = prefault.fault_in(pool)
    assert done > 0.99 * pool.nbytes - (1 << 20)
    assert _resident(pool) > 0.99 * pool.nbytes
    assert torch.equal(pool[1, 0, 100:116], torch.full((16, 4, 64), 7.0))
    assert pool[0].abs().sum() == 0 and pool[1, 1].abs().sum() == 0


def test_an_engine_asked_to_maps_its_pool_in_the_background(model_dir, caplog):
    caplog.set_level(logging.INFO, logger=prefault.__name__)
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir("tiny-llama")), kv_cache_memory_bytes=96 << 20, prefault_kv=True
        )
    )
    pool = engine.runner.kv_cache
    for thread in threading.enumerate():
        if thread.name == "kv-prefault":
            thread.join(timeout=60)
    assert "KV pool mapped ahead" in caplog.text
    assert _resident(pool) > 0.99 * pool.nbytes


def test_shutting_an_engine_down_stops_mapping_its_pool(model_dir, monkeypatch):
    """An engine shut down in a process that goes on (an in-process bench, a test) leaves no
    thread making its pool resident: the mapping here waits until it is told to stop."""

    def until_stopped(pool: torch.Tensor, stop: threading.Event | None = None) -> int:
        assert stop is not None
        stop.wait(120)
        return 0

    monkeypatch.setattr(prefault, "fault_in", until_stopped)
    llm = AsyncLLM(
        EngineConfig(
            model=str(model_dir("tiny-llama")), kv_cache_memory_bytes=96 << 20, prefault_kv=True
        )
    )
    llm.shutdown()
    for thread in threading.enumerate():
        if thread.name == "kv-prefault":
            thread.join(timeout=30)
            assert not thread.is_alive()


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
