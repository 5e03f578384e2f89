"""KV block copies between the device pool and the tiers below it, ours against the gather
we had before, side by side in one run.

    python bench/kv_blocks.py --model smollm2-135m --kv-cache-mib 64 --blocks 1,6,32

Every tier hop copies whole blocks out of or into the worker's pool: a spill to T1 when the
pool evicts a cached block, the write-back to T2 and the PD transfer when a prompt is done
(`ModelRunner.read_kv`), a hit copied up or a fetch imported (`write_kv`). The pool is one
tensor [layers, K/V, slots, kv heads, head dim]. Before: K and V were each gathered from a
view of it (`kv_cache[:, 0].index_select(1, slots)`), which is not contiguous, and torch's
CPU kernel copies such an input whole first, so a read cost time in proportion to the pool,
not to the blocks read. Now: one gather over the pool's slot axis, K and V together.
Times are medians of `--reps` calls, per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from rtp_serve.engine.config import EngineConfig  # noqa: E402
from rtp_serve.engine.llm_engine import LLMEngine  # noqa: E402
from rtp_serve.engine.outputs import PromptKV  # noqa: E402
from rtp_serve.kernels.isa import cpu_isa  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402


def median_us(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def gather_per_view(kv_cache: torch.Tensor, slots: torch.Tensor) -> PromptKV:
    """The read as it was: K and V each gathered from its own (strided) view of the pool."""
    return PromptKV(0, kv_cache[:, 0].index_select(1, slots), kv_cache[:, 1].index_select(1, slots))


def time_blocks(runner, n: int, reps: int) -> tuple[float, float, float]:
    """(read before, read now, write) in microseconds, for blocks 1..n of the pool."""
    ids, end = list(range(1, n + 1)), n * runner.block_size
    slots = runner._slots(ids, 0, end)
    before = median_us(lambda: gather_per_view(runner.kv_cache, slots), reps)
    now = median_us(lambda: runner.read_kv(ids, 0, end), reps)
    kv = runner.read_kv(ids, 0, end)
    if not torch.equal(kv.k, gather_per_view(runner.kv_cache, slots).k):
        raise SystemExit("the two reads disagree")
    return before, now, median_us(lambda: runner.write_kv(ids, kv), reps)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model dir or preset name")
    ap.add_argument("--kv-cache-mib", type=int, default=64, help="the device pool (T0)")
    ap.add_argument("--blocks", default="1,6,32", help="blocks per copy")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=str(resolve_model(args.model)), kv_cache_memory_bytes=args.kv_cache_mib << 20
    )
    engine = LLMEngine(config)
    runner = engine.runner
    pool = runner.kv_cache
    print(f"# cpu: {cpu_isa().describe()}; torch threads {args.threads}")
    print(f"# model {config.model}; pool {tuple(pool.shape)} {pool.dtype}, "
          f"{pool.nbytes / 2**20:.0f} MiB; block {runner.read_kv([0], 0, runner.block_size).nbytes / 1024:.0f} KiB")  # fmt: skip
    print(f"{'blocks':>6} {'read before':>12} {'read now':>10} {'speedup':>8} {'write':>10}")
    for n in (int(b) for b in args.blocks.split(",")):
        before, now, write = time_blocks(runner, n, args.reps)
        print(f"{n:>6} {before:>10.0f}us {now:>8.0f}us {before / now:>7.0f}x {write:>8.0f}us")


if __name__ == "__main__":
    main()
