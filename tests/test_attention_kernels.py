"""Paged attention backends against dense attention computed from scratch."""

from __future__ import annotations

import os

import pytest
import torch

from rtp_serve.kernels import cpu
from rtp_serve.kernels.attention import (
    AttentionMetadata,
    CpuKernelAttention,
    LayerCache,
    PrefillChunk,
    TorchAttention,
    paged_decode,
    paged_prefill,
    write_kv,
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


def slots_of(table, start, end, block_size):
    return torch.tensor(
        [table[t // block_size] * block_size + t % block_size for t in range(start, end)]
    )


def scatter_cache(contexts, num_blocks, block_size, dtype):
    """Place each context [L, Hkv, D] into random blocks of a fresh cache (every other slot
    holding noise, or NaN where it could only be read by mistake); return it and the tables.
    An int8 cache is written the way the engine writes it (one step per context)."""
    hkv, d = contexts[0][0].shape[1:]
    cache = empty_cache(num_blocks, block_size, hkv, d, dtype)
    free = torch.randperm(num_blocks).tolist()
    tables = []
    for k, v in contexts:
        table = [free.pop() for _ in range(-(-k.shape[0] // block_size))]
        write_kv(cache, k, v, slots_of(table, 0, k.shape[0], block_size), block_size)
        tables.append(table)
    return cache, tables


def empty_cache(num_blocks, block_size, hkv, d, dtype) -> LayerCache:
    slots = num_blocks * block_size
    if dtype != torch.int8:
        return LayerCache(
            torch.randn(slots, hkv, d).to(dtype), torch.randn(slots, hkv, d).to(dtype)
        )
    noise = torch.randint(-127, 128, (2, slots, hkv, d), dtype=torch.int8)
    scales = torch.full((2, num_blocks, hkv), float("nan"))  # a stale scale must never be read
    return LayerCache(noise[0], noise[1], scales[0], scales[1])


def stored(cache: LayerCache, table, n, block_size):
    """What the cache holds for the first n tokens of a sequence, in float32."""
    return cache.gather(slots_of(table, 0, n, block_size), block_size, torch.float32)


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
    cache, tables = scatter_cache(contexts, 128, block_size, dtype)
    k_cache, v_cache = cache.k, cache.v
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


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 4])  # 4: a vector of tokens spans blocks (and scales)
def test_paged_decode_reads_a_narrower_cache(q_dtype, kv_dtype, bs):
    """bf16/fp16/int8 KV under a float32 (or bf16) query: the kernel widens (and scales) as it
    reads, and matches dense attention over what the cache holds (tolerance: the query
    dtype's)."""
    torch.manual_seed(3)
    hq, hkv, d = 8, 2, 32
    lens = [1, 17, 64, 90]
    contexts = [(torch.randn(n, hkv, d), torch.randn(n, hkv, d)) for n in lens]
    cache, tables = scatter_cache(contexts, 64, bs, kv_dtype)
    q = torch.randn(len(lens), hq, d).to(q_dtype)
    scale = d**-0.5
    expected = torch.stack(
        [
            dense(q[i : i + 1], *stored(cache, table, n, bs), scale)[0]
            for i, (table, n) in enumerate(zip(tables, lens, strict=True))
        ]
    )
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    for name, impl in _decode_impls():
        out = impl(
            q, cache.k, cache.v, padded(tables), torch.tensor(lens), bs, scale,
            cache.k_scale, cache.v_scale,
        )  # fmt: skip
        assert out.dtype == q_dtype, name
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("n_threads", [1, 2, 5])
def test_paged_decode_splits_few_long_sequences_into_runs(kv_dtype, n_threads):
    """Batch 1 and 2 of long contexts: the kernel splits each sequence's tokens into runs
    of whole blocks (more runs on more threads) and merges their softmax partials, a run
    whose scores dwarf the others' included; the result is the whole sequence's
    attention."""
    torch.manual_seed(5)
    hq, hkv, d, bs = 12, 4, 64, 16
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        for lens in ([1000], [700, 3], [129, 64]):
            contexts = [(torch.randn(n, hkv, d), torch.randn(n, hkv, d)) for n in lens]
            contexts[0][0][-5:] *= 8  # the last run's scores dwarf the others'
            cache, tables = scatter_cache(contexts, 128, bs, kv_dtype)
            q = torch.randn(len(lens), hq, d)
            scale = d**-0.5
            expected = torch.stack(
                [
                    dense(q[i : i + 1], *stored(cache, table, n, bs), scale)[0]
                    for i, (table, n) in enumerate(zip(tables, lens, strict=True))
                ]
            )
            for name, impl in _decode_impls():
                out = impl(
                    q, cache.k, cache.v, padded(tables), torch.tensor(lens), bs, scale,
                    cache.k_scale, cache.v_scale,
                )  # fmt: skip
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=name)
    finally:
        torch.set_num_threads(before)


def _prefill_impls():
    impls = [("reference", paged_prefill)]
    ops = cpu.load()
    if ops is not None:

        def kernel(q, cache, table, ctx_len, bs, scale):
            return ops.paged_prefill(
                q, cache.k, cache.v, table, ctx_len, bs, scale, cache.k_scale, cache.v_scale
            )

        impls.append(("cpu-kernel", kernel))
    return impls


GQA_4 = (8, 2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(
    "ctx_len,n,bs,d,heads",
    [
        (0, 7, 4, 16, GQA_4),
        (16, 5, 4, 16, GQA_4),
        (20, 33, 4, 16, GQA_4),
        (3, 1, 4, 16, GQA_4),
        # block size 16 with head dim 64 or 128 take the kernel's fixed-size loops
        (32, 40, 16, 64, GQA_4),
        (45, 19, 16, 64, GQA_4),
        (0, 50, 16, 64, GQA_4),
        (17, 3, 16, 128, GQA_4),
        (5, 21, 16, 32, GQA_4),
        # hundreds of tokens, MHA and GQA 3: several query tiles per kv head, and softmax
        # chunks of 64 keys whose last one ends mid-chunk
        *((c, n, 16, 64, h) for c, n in ((0, 270), (100, 150), (63, 65), (64, 1))
          for h in ((12, 12), (9, 3))),
    ],
)  # fmt: skip
def test_paged_prefill_matches_dense(ctx_len, n, bs, d, heads, kv_dtype):
    """New tokens after a cached prefix (block boundaries, chunks spanning several blocks and
    query tiles), read in place, against dense attention over what the cache holds."""
    torch.manual_seed(1)
    hq, hkv = heads
    k, v = torch.randn(ctx_len + n, hkv, d), torch.randn(ctx_len + n, hkv, d)
    cache, (table,) = scatter_cache([(k, v)], 64, bs, kv_dtype)
    q = torch.randn(n, hq, d)
    expected = dense(q, *stored(cache, table, ctx_len + n, bs), d**-0.5)
    for name, impl in _prefill_impls():
        out = impl(q, cache, torch.tensor(table), ctx_len, bs, d**-0.5)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_paged_prefill_kernel_in_the_query_dtype(q_dtype):
    torch.manual_seed(5)
    hq, hkv, d, bs, ctx_len, n = 4, 4, 32, 16, 24, 20
    k, v = torch.randn(ctx_len + n, hkv, d), torch.randn(ctx_len + n, hkv, d)
    cache, (table,) = scatter_cache([(k, v)], 16, bs, q_dtype)
    q = torch.randn(n, hq, d).to(q_dtype)
    expected = dense(q, *stored(cache, table, ctx_len + n, bs), d**-0.5)
    for name, impl in _prefill_impls():
        out = impl(q, cache, torch.tensor(table), ctx_len, bs, d**-0.5)
        assert out.dtype == q_dtype, name
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2, msg=name)


def _backends(scale):
    backends = [TorchAttention(scale)]
    ops = cpu.load()
    if ops is not None:
        backends.append(CpuKernelAttention(scale, ops))
    return backends


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_mixed_batch_writes_kv_then_attends(kv_dtype):
    """Decodes, a chunk after cached context and a fresh prompt in one flat batch: each
    backend writes the new K/V, then attends over the cache (the new tokens included)."""
    torch.manual_seed(2)
    hq, hkv, d, bs = 4, 2, 16, 4
    # (context already cached, new tokens this step) per sequence; decodes first.
    seqs = [(6, 1), (12, 1), (5, 7), (0, 9)]
    full = [(torch.randn(c + n, hkv, d), torch.randn(c + n, hkv, d)) for c, n in seqs]
    cached = [
        (k[:c], v[:c]) if c else (k[:0], v[:0]) for (c, _), (k, v) in zip(seqs, full, strict=True)
    ]
    template = empty_cache(64, bs, hkv, d, kv_dtype)
    free = torch.randperm(64).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in seqs]
    for (c, _), table, (k, v) in zip(seqs, tables, cached, strict=True):
        if c:
            write_kv(template, k, v, slots_of(table, 0, c, bs), bs)
    q = torch.randn(sum(n for _, n in seqs), hq, d)
    k_new = torch.cat([k[c:] for (c, _), (k, _) in zip(seqs, full, strict=True)])
    v_new = torch.cat([v[c:] for (c, _), (_, v) in zip(seqs, full, strict=True)])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(
            [slots_of(t, c, c + n, bs) for (c, n), t in zip(seqs, tables, strict=True)]
        ),
        block_size=bs,
        num_decodes=2,
        decode_block_tables=padded(tables[:2]),
        decode_seq_lens=torch.tensor([7, 13]),
        prefills=[
            PrefillChunk(2, 7, 5, torch.tensor(tables[2])),
            PrefillChunk(9, 9, 0, torch.tensor(tables[3])),
        ],
    )
    offsets = [0, 1, 2, 9, 18]
    for backend in _backends(d**-0.5):
        cache = LayerCache(*(None if t is None else t.clone() for t in (
            template.k, template.v, template.k_scale, template.v_scale)))  # fmt: skip
        out = backend.forward(q, k_new, v_new, cache, meta)
        # A full-precision cache holds exactly the inputs; any cache: what attention read.
        expected = torch.cat(
            [
                dense(q[offsets[i] : offsets[i + 1]], *stored(cache, t, c + n, bs), d**-0.5)
                for i, ((c, n), t) in enumerate(zip(seqs, tables, strict=True))
            ]
        )
        if kv_dtype == torch.float32:
            exact = torch.cat(
                [
                    dense(q[offsets[i] : offsets[i + 1]], k, v, d**-0.5)
                    for i, (k, v) in enumerate(full)
                ]
            )
            torch.testing.assert_close(expected, exact)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=type(backend).__name__)


@pytest.mark.parametrize("n_threads", [1, 3, 7])
def test_attention_kernels_at_any_thread_count(n_threads):
    """The kernels' tasks are taken by the threads in turn (kernels/csrc/parallel.h): the
    same results at thread counts that divide nothing evenly, or exceed the tasks."""
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        test_paged_decode_matches_dense(torch.float32, 1e-5, (8, 2), 16)
        test_paged_prefill_matches_dense(20, 33, 4, 16, GQA_4, torch.float32)
        test_paged_prefill_matches_dense(45, 19, 16, 64, GQA_4, torch.int8)
    finally:
        torch.set_num_threads(before)
