"""The KV cache sized from the machine: MemAvailable, a cgroup limit, the workers sharing it,
the weights; and a worker that sizes itself so."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rtp_serve.core.model_config import ModelConfig
from rtp_serve.engine import memory
from rtp_serve.engine.memory import (
    CUDA_OVERHEAD_BYTES,
    MIN_KV_BYTES,
    activation_bytes,
    available_memory_bytes,
    cuda_kv_budget,
    int8_dequant_bytes,
    kv_budget,
    kv_budget_for_device,
    weights_bytes,
)
from tests.procs import grpc_service

GIB = 1 << 30


def _fake(tmp: Path, available_kib: int, cgroup: dict[str, str] | None = None) -> tuple[Path, Path]:
    proc, cg = tmp / "proc", tmp / "cgroup"
    proc.mkdir(parents=True)
    cg.mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       99999999 kB\nMemFree:        1 kB\nMemAvailable:   {available_kib} kB\n"
    )
    for name, value in (cgroup or {}).items():
        (cg / name).parent.mkdir(parents=True, exist_ok=True)
        (cg / name).write_text(value + "\n")
    return proc, cg


def test_available_memory_is_meminfo_capped_by_a_cgroup_limit(tmp_path):
    proc, cg = _fake(tmp_path / "a", 8 * 1024 * 1024)
    assert available_memory_bytes(proc, cg) == 8 * GIB  # no cgroup files: the host's
    proc, cg = _fake(tmp_path / "b", 8 * 1024 * 1024, {"memory.max": "max", "memory.current": "5"})
    assert available_memory_bytes(proc, cg) == 8 * GIB  # v2 without a limit
    limited = {"memory.max": str(3 * GIB), "memory.current": str(1 * GIB)}
    proc, cg = _fake(tmp_path / "c", 8 * 1024 * 1024, limited)
    assert available_memory_bytes(proc, cg) == 2 * GIB  # v2: what is left under the limit
    v1 = {"memory/memory.limit_in_bytes": str(4 * GIB), "memory/memory.usage_in_bytes": "0"}
    proc, cg = _fake(tmp_path / "d", 8 * 1024 * 1024, v1)
    assert available_memory_bytes(proc, cg) == 4 * GIB


def test_weights_are_counted_in_the_served_dtype(model_dir):
    tiny = model_dir("tiny-llama")
    fp32 = weights_bytes(tiny, "float32")
    on_disk = sum(f.stat().st_size for f in tiny.glob("*.safetensors"))
    assert 0.99 * on_disk < fp32 <= on_disk  # the float32 checkpoint, less its headers
    assert weights_bytes(tiny, "bfloat16") * 2 == fp32


def test_budget_splits_the_fraction_among_workers_less_weights(model_dir):
    tiny = model_dir("tiny-llama")
    w = weights_bytes(tiny, "float32")
    one = kv_budget(tiny, "float32", fraction=0.5, share=1, available=16 * GIB)
    two = kv_budget(tiny, "float32", fraction=0.5, share=2, available=16 * GIB)
    assert one.kv_bytes == 8 * GIB - w and two.kv_bytes == 4 * GIB - w
    assert "16.0 GiB available x 0.5 / 2 worker(s)" in two.describe()
    # Too little memory: a small floor, not zero (the worker still serves short requests).
    assert kv_budget(tiny, "float32", 0.5, 64, available=GIB).kv_bytes == MIN_KV_BYTES
    with pytest.raises(ValueError, match="fraction"):
        kv_budget(tiny, "float32", fraction=0.0)
    with pytest.raises(ValueError, match="share"):
        kv_budget(tiny, "float32", share=0)


def test_a_worker_sizes_its_cache_from_the_machine(model_dir):
    from rtp_serve.services.common import grpc_util
    from rtp_serve.services.common.pb import worker_pb2, worker_pb2_grpc

    tiny = model_dir("tiny-llama")
    flags = ("--model", str(tiny), "--threads", "1", "--kv-cache-mib", "auto")
    flags += ("--memory-fraction", "0.02", "--memory-share", "2")

    async def stats(address: str) -> worker_pb2.WorkerStats:
        async with grpc_util.channel(address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            return await stub.Stats(worker_pb2.WorkerStatsRequest(), timeout=10)

    # At most what 64 sequences (the default max_num_seqs) at full context (2048) can use.
    expected = min(kv_budget(tiny, "float32", 0.02, 2).kv_bytes, 64 * 2048 * 2048)
    with grpc_service("fused", *flags) as (address, _):
        s = asyncio.run(stats(address))
    # tiny-llama: 4 layers x 2 kv heads x 32 dims x K and V x 4 bytes = 2 KiB per token.
    got = s.total_blocks * s.block_size * 2048
    assert s.block_size == 16
    assert 0.8 * expected < got <= 1.2 * expected  # MemAvailable moves a little meanwhile


def test_a_gpu_budget_is_its_share_of_the_device_less_weights_and_activations():
    w, reserved = 3 * GIB, GIB
    # 80 GiB, 20 free (another process holds the rest): what is free bounds it.
    b = cuda_kv_budget(w, free=20 * GIB, total=80 * GIB, reserved=reserved, fraction=0.9)
    assert b.kv_bytes == 20 * GIB - w - reserved
    # All free, four workers on it: each its share of 90%.
    b = cuda_kv_budget(w, 80 * GIB, 80 * GIB, reserved, fraction=0.9, share=4, device="cuda:1")
    assert b.kv_bytes == int(80 * GIB * 0.9 / 4) - w - reserved
    assert "80.0 GiB free on cuda:1, 80.0 GiB x 0.9 / 4 worker(s)" in b.describe()
    assert cuda_kv_budget(w, 4 * GIB, 80 * GIB, reserved).kv_bytes == MIN_KV_BYTES
    with pytest.raises(ValueError, match="fraction"):
        cuda_kv_budget(w, GIB, GIB, 0, fraction=1.5)


def test_activations_count_tokens_and_sampled_rows(model_dir):
    cfg = ModelConfig.from_dir(model_dir("tiny-llama"))
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = 4 * cfg.hidden_size + qkv + 3 * cfg.intermediate_size
    assert activation_bytes(cfg, "bfloat16", 10, 3) == 10 * per_token * 2 + 3 * 16 * cfg.vocab_size
    assert activation_bytes(cfg, "float32", 10, 0) == 10 * per_token * 4


def test_a_cuda_device_is_sized_from_device_memory_not_the_hosts(model_dir):
    tiny = model_dir("tiny-llama")
    cfg = ModelConfig.from_dir(tiny)
    asked: list[str] = []

    def device_memory(device: str) -> tuple[int, int]:  # what mem_get_info would say
        asked.append(device)
        return 30 * GIB, 40 * GIB

    b = kv_budget_for_device(
        "cuda:1", tiny, cfg, "bfloat16", None, 1, "auto", 2048, 64, 128, device_memory
    )
    reserved = (
        activation_bytes(cfg, "bfloat16", 2048, 64)
        + activation_bytes(cfg, "bfloat16", 128, 128)
        + CUDA_OVERHEAD_BYTES
    )
    assert asked == ["cuda:1"]
    assert b.device == "cuda:1" and b.reserved_bytes == reserved
    assert b.kv_bytes == 30 * GIB - weights_bytes(tiny, "bfloat16") - reserved  # 0.9 x 40 > 30

    def no_device(device: str) -> tuple[int, int]:
        raise AssertionError(f"asked device memory for {device}")

    # INT8 weights: the largest projection's transient dequantized copies are held back too.
    int8 = kv_budget_for_device(
        "cuda:1", tiny, cfg, "bfloat16", None, 1, "int8", 2048, 64, 128, device_memory
    )
    assert int8.reserved_bytes == reserved + int8_dequant_bytes(cfg, "bfloat16")
    gate_up = 2 * cfg.intermediate_size * cfg.hidden_size  # tiny-llama's largest
    assert int8_dequant_bytes(cfg, "bfloat16") == gate_up * (4 + 4 + 2)

    host = kv_budget_for_device("cpu", tiny, cfg, "float32", 0.02, 2, "auto", 2048, 64, 128,
                                no_device)  # fmt: skip
    assert host.device == "host" and host.fraction == 0.02 and host.share == 2


def test_worker_flags_size_a_cuda_cache_from_the_device(model_dir, monkeypatch):
    """`--device cuda --kv-cache-mib auto` takes the device branch (the driver's numbers
    stood in for by memory.cuda_memory, the one function that asks torch)."""
    import argparse

    from rtp_serve.services.worker.config import add_worker_arguments, engine_config

    free = 700 << 20  # under the cap of 64 sequences at full context (256 MiB of KV)
    monkeypatch.setattr(memory, "cuda_memory", lambda device: (free, 2 * GIB))
    p = argparse.ArgumentParser()
    add_worker_arguments(p)
    tiny = model_dir("tiny-llama")
    config = engine_config(p.parse_args(["--model", str(tiny), "--device", "cuda"]))
    cfg = ModelConfig.from_dir(tiny)
    reserved = (
        activation_bytes(cfg, "float32", 2048, 64)
        + activation_bytes(cfg, "float32", 128, 128)
        + CUDA_OVERHEAD_BYTES
    )
    assert config.kv_cache_memory_bytes == free - weights_bytes(tiny, "float32") - reserved
