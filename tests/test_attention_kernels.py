"""Paged attention backends against dense attention computed from scratch."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import cpu
from kernels.attention import (
    AttentionMetadata,
    CpuKernelAttention,
    PrefillChunk,
    TorchAttention,
    paged_decode,
    paged_prefill,
)


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


def _backends(scale):
    backends = [TorchAttention(scale)]
    ops = cpu.load()
    if ops is not None:
        backends.append(CpuKernelAttention(scale, ops))
    return backends


def test_mixed_batch_writes_kv_then_attends():
    """Decodes, a chunk after cached context and a fresh prompt in one flat batch."""
    torch.manual_seed(2)
    hq, hkv, d, bs = 4, 2, 16, 4
    # (context already cached, new tokens this step) per sequence; decodes first.
    seqs = [(6, 1), (12, 1), (5, 7), (0, 9)]
    full = [(torch.randn(c + n, hkv, d), torch.randn(c + n, hkv, d)) for c, n in seqs]
    k_cache, v_cache, tables = scatter_cache(full, 64, bs, torch.float32)
    for (c, n), table in zip(seqs, tables, strict=True):  # forget the new tokens' K/V
        new_slots = [table[t // bs] * bs + t % bs for t in range(c, c + n)]
        k_cache[new_slots] = 0.0
        v_cache[new_slots] = 0.0

    def slots_of(table, start, end):
        return torch.tensor([table[t // bs] * bs + t % bs for t in range(start, end)])

    q = torch.randn(sum(n for _, n in seqs), hq, d)
    k_new = torch.cat([k[c:] for (c, _), (k, _) in zip(seqs, full, strict=True)])
    v_new = torch.cat([v[c:] for (c, _), (_, v) in zip(seqs, full, strict=True)])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(
            [slots_of(t, c, c + n) for (c, n), t in zip(seqs, tables, strict=True)]
        ),
        block_size=bs,
        num_decodes=2,
        decode_block_tables=padded(tables[:2]),
        decode_seq_lens=torch.tensor([7, 13]),
        prefills=[PrefillChunk(2, 7, 5, slots_of(tables[2], 0, 12)), PrefillChunk(9, 9, 0, None)],
    )
    offsets = [0, 1, 2, 9, 18]
    expected = torch.cat(
        [dense(q[offsets[i] : offsets[i + 1]], k, v, d**-0.5) for i, (k, v) in enumerate(full)]
    )
    for backend in _backends(d**-0.5):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = backend.forward(q, k_new, v_new, kc, vc, meta)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=type(backend).__name__)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_reads_a_narrower_cache(q_dtype, kv_dtype):
    """bf16/fp16 KV under a float32 (or bf16) query: the kernel widens as it reads, and
    matches dense attention over the rounded K/V (tolerance: the query dtype's)."""
    torch.manual_seed(3)
    hq, hkv, d, bs = 8, 2, 32, 16
    lens = [1, 17, 64, 90]
    contexts = [(torch.randn(n, hkv, d), torch.randn(n, hkv, d)) for n in lens]
    k_cache, v_cache, tables = scatter_cache(contexts, 64, bs, kv_dtype)
    q = torch.randn(len(lens), hq, d).to(q_dtype)
    scale = d**-0.5
    expected = torch.stack(
        [
            dense(q[i : i + 1], k.to(kv_dtype), v.to(kv_dtype), scale)[0]
            for i, (k, v) in enumerate(contexts)
        ]
    )
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    for name, impl in _decode_impls():
        out = impl(q, k_cache, v_cache, padded(tables), torch.tensor(lens), bs, scale)
        assert out.dtype == q_dtype, name
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol, msg=name)


def test_prefill_over_a_narrower_cache():
    """A chunk after a cached prefix, the cache in bf16 and the model in float32."""
    torch.manual_seed(4)
    hq, hkv, d, bs, ctx_len, n = 8, 2, 16, 4, 21, 6
    k, v = torch.randn(ctx_len + n, hkv, d), torch.randn(ctx_len + n, hkv, d)
    k_cache, v_cache, (table,) = scatter_cache([(k, v)], 64, bs, torch.bfloat16)
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(ctx_len + n)])
    q = torch.randn(n, hq, d)
    out = paged_prefill(q, k_cache, v_cache, slots, ctx_len, d**-0.5)
    assert out.dtype == torch.float32
    expected = dense(q, k.bfloat16(), v.bfloat16(), d**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
