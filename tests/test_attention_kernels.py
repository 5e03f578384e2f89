"""Paged attention backends against dense attention computed from scratch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu
from kernels.attention import paged_decode, paged_prefill


def dense(q, k, v, scale):
    """Causal attention of the last len(q) positions over k/v [L, Hkv, D] (GQA by repeat)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    n, total = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    mask = torch.ones(n, total, dtype=torch.bool).tril(diagonal=total - n)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float())


def scatter_cache(contexts, num_blocks, block_size, dtype):
    """Place each context [L, Hkv, D] into random blocks of a fresh cache; return tables."""
    hkv, d = contexts[0][0].shape[1:]
    k_cache = torch.randn(num_blocks * block_size, hkv, d).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, hkv, d).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    tables = []
    for k, v in contexts:
        n_blocks = -(-k.shape[0] // block_size)
        table = [free.pop() for _ in range(n_blocks)]
        slots = torch.tensor(
            [table[t // block_size] * block_size + t % block_size for t in range(k.shape[0])]
        )
        k_cache[slots], v_cache[slots] = k.to(dtype), v.to(dtype)
        tables.append(table)
    return k_cache, v_cache, tables


def padded(tables):
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


def _decode_impls():
    impls = [("reference", paged_decode)]
    ops = cpu.load()
    if ops is not None:
        impls.append(("cpu-kernel", ops.paged_decode))
    elif os.environ.get("RTP_SERVE_CPU_KERNELS", "1") != "0":
        pytest.fail("the CPU kernel did not build (set RTP_SERVE_CPU_KERNELS=0 to run without)")
    return impls


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (12, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_matches_dense(dtype, tol, heads, block_size):
    torch.manual_seed(0)
    hq, hkv, d = *heads, 32
    lens = [1, 5, block_size, 37, 100]
    contexts = [(torch.randn(n, hkv, d), torch.randn(n, hkv, d)) for n in lens]
    k_cache, v_cache, tables = scatter_cache(contexts, 128, block_size, dtype)
    q = torch.randn(len(lens), hq, d).to(dtype)
    scale = d**-0.5
    expected = torch.stack(
        [
            dense(q[i : i + 1], k.to(dtype), v.to(dtype), scale)[0]
            for i, (k, v) in enumerate(contexts)
        ]
    )
    for name, impl in _decode_impls():
        out = impl(q, k_cache, v_cache, padded(tables), torch.tensor(lens), block_size, scale)
        assert out.dtype == dtype, name
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("ctx_len,n", [(0, 7), (16, 5), (20, 33), (3, 1)])
def test_paged_prefill_matches_dense(ctx_len, n):
    torch.manual_seed(1)
    hq, hkv, d, bs = 8, 2, 16, 4
    k, v = torch.randn(ctx_len + n, hkv, d), torch.randn(ctx_len + n, hkv, d)
    k_cache, v_cache, (table,) = scatter_cache([(k, v)], 64, bs, torch.float32)
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(ctx_len + n)])
    q = torch.randn(n, hq, d)
    out = paged_prefill(q, k_cache, v_cache, slots, ctx_len, d**-0.5)
    torch.testing.assert_close(out, dense(q, k, v, d**-0.5), atol=1e-5, rtol=1e-5)


def test_fresh_prefill_is_plain_causal_attention():
    # The no-context path (is_causal SDPA) agrees with the dense reference too.
    torch.manual_seed(2)
    q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, dense(q, k, v, 16**-0.5), atol=1e-5, rtol=1e-5)
