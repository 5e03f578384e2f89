"""The KV pool reads as zeros however it is allocated: written (small pools) or a fresh
mapping the kernel zero-fills on first touch (large CPU pools, engine/model_runner.py)."""

from __future__ import annotations

import torch

from rtp_serve.engine.model_runner import _FRESH_MAPPING_BYTES, _kv_pool


def test_small_and_large_pools_read_as_zeros():
    for numel in (1024, _FRESH_MAPPING_BYTES // 2 + 64):  # 4 KiB; a float32 pool of 128 MiB
        for _ in range(2):  # the second after the first was freed: no recycled bytes
            pool = _kv_pool((numel,), torch.float32, torch.device("cpu"))
            assert pool.shape == (numel,) and not pool.any()
            pool.fill_(float("nan"))
            del pool
