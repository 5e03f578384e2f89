"""Paged attention kernels against the torch reference, side by side in one run.

    python bench/attention.py [--threads 2] [--heads 12 4] [--head-dim 64]

Header: the CPU's ISA level and flags. Per KV dtype (float32, bfloat16, int8; the query in
float32, or bfloat16 over a bf16 cache):
  decode B batch B = 1, 4 (a served load's small batches) and 48 (the engine benchmark's
           offline workload), contexts of 200..296 tokens; per layer, over as many
           layers' caches as fill 256 MiB, so that each reads its KV from memory as a
           decode step does, not from a cache warmed by the previous call. Each
           sequence's blocks lie in order, as a fresh batch's do ("decode 48 scattered":
           in random order, as after much eviction)
  prefill  256 new tokens after a cached prefix of 1024 (a prefix-cache hit, a later chunk)
  new N    a prompt of N tokens with nothing cached (N = 200, 1024, 2048; the reference is
           SDPA's causal kernel on the new K/V, as the engine runs it; KV in the query's dtype)
  write    256 new rows into the cache (int8: the adaptive scale writer)
Each cell is the best of several runs, in milliseconds; the reference gathers the context
into a contiguous copy, the kernels read the blocks in place.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from rtp_serve.kernels import cpu  # noqa: E402
from rtp_serve.kernels.attention import (  # noqa: E402
    LayerCache,
    _attend,
    paged_decode,
    paged_prefill,
    write_kv,
)
from rtp_serve.kernels.isa import cpu_isa  # noqa: E402
from rtp_serve.kernels.kv_quant import write_int8  # noqa: E402

BLOCK = 16
DECODE_BYTES = 256 << 20  # the decode rows' layers' caches together: more than any L3


def best_ms(fn, reps: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def per_layer(layers: list[LayerCache], attend) -> None:
    for cache in layers:
        attend(cache)


def make_cache(num_blocks: int, kv_heads: int, dim: int, dtype: torch.dtype) -> LayerCache:
    slots = num_blocks * BLOCK
    k, v = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    if dtype != torch.int8:
        return LayerCache(k.to(dtype), v.to(dtype))
    cache = LayerCache(
        torch.empty(slots, kv_heads, dim, dtype=torch.int8),
        torch.empty(slots, kv_heads, dim, dtype=torch.int8),
        torch.zeros(num_blocks, kv_heads),
        torch.zeros(num_blocks, kv_heads),
    )
    write_kv(cache, k, v, torch.arange(slots), BLOCK)
    return cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--heads", type=int, nargs=2, default=(12, 4), metavar=("Q", "KV"),
                   help="query and kv heads (default 12 4; llama-100m has 12 12, smollm2-135m "
                        "9 3): a decode step reads the kv heads' K and V")  # fmt: skip
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu.load()
    q_heads, kv_heads = args.heads  # the default is no model's: name the shape on every run
    print(f"cpu: {cpu_isa().describe()}; threads {args.threads}; "
          f"{q_heads} query and {kv_heads} kv heads of {args.head_dim}")  # fmt: skip
    if ops is None:
        print("compiled kernels unavailable: only the reference runs")
    print(f"{'kv dtype':<10}{'op':<10}{'reference ms':>14}{'kernel ms':>11}{'speedup':>9}")
    for kv_dtype in (torch.float32, torch.bfloat16, torch.int8):
        for op, ref, kernel, calls in cases(kv_dtype, ops, *args.heads, args.head_dim):
            name, ref_ms = str(kv_dtype).removeprefix("torch."), best_ms(ref) / calls
            if kernel is None:
                print(f"{name:<10}{op:<10}{ref_ms:>14.2f}{'-':>11}{'-':>9}")
                continue
            k_ms = best_ms(kernel) / calls
            print(f"{name:<10}{op:<10}{ref_ms:>14.2f}{k_ms:>11.2f}{ref_ms / k_ms:>8.2f}x")


def cases(kv_dtype: torch.dtype, ops, hq: int, hkv: int, d: int):
    """(op, reference, kernel or None, the calls each makes) for one KV dtype."""
    scale = d**-0.5
    q_dtype = torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float32
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(200, 297, (48,), generator=g)
    per_seq = -(-int(lens.max()) // BLOCK)
    # Blocks in order, as a fresh batch takes them from the pool (the engine's decode
    # steps read them so); "scattered": in random order, as after much eviction. The
    # order alone moved float32 decode 48 (GQA 9/3) from 0.75 to 1.40 ms: the hardware
    # prefetchers follow one sequence's blocks only when they are adjacent.
    in_order = torch.arange(48 * per_seq).view(48, per_seq)
    scattered = torch.randperm(48 * per_seq, generator=g).view(48, per_seq)
    ctx, n = 1024, 256
    prefill_table = torch.randperm(-(-(ctx + n) // BLOCK), generator=g)
    cache = make_cache(48 * per_seq, hkv, d, kv_dtype)
    sc = (cache.k_scale, cache.v_scale)
    q1 = torch.randn(48, hq, d).to(q_dtype)
    qn = torch.randn(n, hq, d).to(q_dtype)
    layer_bytes = cache.k.nbytes + cache.v.nbytes
    layers = [cache] + [
        make_cache(48 * per_seq, hkv, d, kv_dtype) for _ in range(DECODE_BYTES // layer_bytes)
    ]
    for b, tables, label in ((1, in_order, ""), (4, in_order, ""), (48, in_order, ""),
                             (48, scattered, " scattered")):  # fmt: skip
        qb, tb, lb = q1[:b], tables[:b], lens[:b]
        yield (
            f"decode {b}{label}",
            lambda qb=qb, tb=tb, lb=lb: per_layer(
                layers,
                lambda c: paged_decode(qb, c.k, c.v, tb, lb, BLOCK, scale, c.k_scale, c.v_scale),
            ),
            ops
            and (
                lambda qb=qb, tb=tb, lb=lb: per_layer(
                    layers,
                    lambda c: ops.paged_decode(
                        qb, c.k, c.v, tb, lb, BLOCK, scale, c.k_scale, c.v_scale
                    ),
                )
            ),
            len(layers),
        )
    yield (
        "prefill",
        lambda: paged_prefill(qn, cache, prefill_table, ctx, BLOCK, scale),
        ops
        and (
            lambda: ops.paged_prefill(qn, cache.k, cache.v, prefill_table, ctx, BLOCK, scale, *sc)
        ),
        1,
    )
    for new in (200, 1024, 2048) if kv_dtype != torch.int8 else ():
        fresh = make_cache(-(-new // BLOCK), hkv, d, kv_dtype)
        qf = torch.randn(new, hq, d).to(q_dtype)
        kf, vf, table = fresh.k[:new], fresh.v[:new], torch.arange(-(-new // BLOCK))
        yield (
            f"new {new}",
            lambda qf=qf, kf=kf, vf=vf: _attend(qf, kf, vf, None, scale, causal=True),
            ops
            and (
                lambda qf=qf, fresh=fresh, table=table: ops.paged_prefill(
                    qf, fresh.k, fresh.v, table, 0, BLOCK, scale
                )
            ),
            1,
        )
    if kv_dtype == torch.int8:
        rows = torch.randn(n, hkv, d)
        slots = torch.arange(n) + 7 * BLOCK  # from a block boundary
        yield (
            "write",
            lambda: write_int8(cache.k, cache.k_scale, rows, slots, BLOCK),
            ops and (lambda: ops.kv_write_int8(cache.k, cache.k_scale, rows, slots, BLOCK)),
            1,
        )


if __name__ == "__main__":
    main()
