"""The compiled K/V write into a float cache (kernels/csrc/kv_write.cpp) against torch's
index_copy_, which it replaces: the same bytes in every slot, for caches as wide as the
model and narrower, from the strided column slices the model hands it (`ops`: the
compiled kernels, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from rtp_serve.kernels.attention import LayerCache, write_kv

HEADS, DIM, SLOTS = 3, 16, 512


def _rows(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the model has them: column slices of one [T, (Hq + 2 Hkv) D] output."""
    qkv = torch.randn(tokens, (2 + 2) * HEADS * DIM).to(dtype)
    k = qkv[:, 2 * HEADS * DIM : 3 * HEADS * DIM].view(tokens, HEADS, DIM)
    v = qkv[:, 3 * HEADS * DIM :].view(tokens, HEADS, DIM)
    return k, v


def _caches(dtype: torch.dtype) -> tuple[LayerCache, LayerCache]:
    fill = torch.full((SLOTS, HEADS, DIM), -7.0, dtype=dtype)
    return LayerCache(fill.clone(), fill.clone()), LayerCache(fill.clone(), fill.clone())


@pytest.mark.parametrize(
    "src,kv",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("tokens", [1, 48, 300])  # 300: split among the threads
def test_kv_write_matches_index_copy(ops, src, kv, tokens):
    torch.manual_seed(tokens)
    k, v = _rows(tokens, src)
    slots = torch.randperm(SLOTS)[:tokens]  # any order, any blocks
    ref, got = _caches(kv)
    write_kv(ref, k, v, slots, 16)
    write_kv(got, k, v, slots, 16, write_float=ops.kv_write)
    assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert (got.k[untouched] == -7).all() and (got.v[untouched] == -7).all()


def test_kv_write_refuses_what_it_cannot_write(ops):
    k, v = _rows(4, torch.float32)
    cache = _caches(torch.float32)[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.kv_write(cache.k, cache.v, k, v, torch.tensor([0, 1, 2, SLOTS]))
    with pytest.raises(RuntimeError, match="one slot per row"):
        ops.kv_write(cache.k, cache.v, k, v, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        int8 = torch.zeros(SLOTS, HEADS, DIM, dtype=torch.int8)
        ops.kv_write(int8, int8.clone(), k, v, torch.arange(4))
    with pytest.raises(RuntimeError, match="rows must be"):
        ops.kv_write(cache.k, cache.v, k[:, :2], v[:, :2], torch.arange(4))
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.kv_write(cache.k, cache.v, k.transpose(1, 2).contiguous().transpose(1, 2), v,
                     torch.arange(4))  # fmt: skip
