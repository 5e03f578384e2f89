"""The machine's ceilings, measured in the run that uses them: what bench/roofline.py
divides a workload by.

  GEMM peak       FLOP/s of a prefill-sized projection (2048 x 768 x 4096) through the
                  engine's fastest large-batch path (oneDNN, MKL or packed_gemm)
  read bandwidth  bytes/s that a reduction over a large tensor reads on the process's
                  threads: the ceiling of a decode step, which streams its weights and KV
                  and writes next to nothing
  copy bandwidth  bytes/s moved (read + write) by a large copy: reads and writes
                  counted together, so not the ceiling of a read stream
Both bandwidths drift on a shared host: a sum over 256 MiB buffers read 27-35 GB/s for
minutes on the Zen 4 VM of docs/benchmarks.md, and 50-66 in quieter spells. A floor is as
good as the ceilings measured for it: compare shares within one run.

    python bench/ceilings.py [--dtypes float32,bfloat16,w8a8] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path: the repository root instead.
_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import torch  # noqa: E402

from bench.roofline import Machine  # noqa: E402
from rtp_serve.kernels.linear import cpu_kernels, make_linear  # noqa: E402


def best_seconds(fn, reps: int) -> float:
    """The fastest of `reps` calls of fn, after one to warm up: on a shared machine the best
    run is the closest to what the CPU can do."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes per second moved (read + write) by a large tensor copy."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), reps)


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes per second read by a sum over a tensor far larger than the caches."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_seconds(src.sum, reps)


def gemm_peak(
    dtype: torch.dtype,
    m: int = 2048,
    k: int = 768,
    n: int = 4096,
    weight_dtype: str = "auto",
    reps: int = 20,
) -> float:
    """FLOP/s of a prefill-sized projection through the fastest of the engine's own paths
    for large batches (every path of the op but rows_gemm, built for a few rows; the best
    of `reps` each)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    op = make_linear(w, dtype, weight_dtype, cpu_kernels(torch.device("cpu")))
    x = torch.randn(m, k, generator=g).to(dtype)
    paths = op.paths() if hasattr(op, "paths") else {"op": op}
    if len(paths) > 1:
        paths.pop("rows_gemm", None)
    return 2 * m * k * n / min(best_seconds(lambda p=p: p(x), reps) for p in paths.values())


def measure_machine(
    dtypes: Sequence[str] = ("float32", "bfloat16", "w8a8"), reps: int = 20
) -> Machine:
    """The ceilings; a peak not asked for in `dtypes` is NaN (each takes seconds)."""

    def peak(name: str, dtype: torch.dtype, weight_dtype: str = "auto") -> float:
        if name not in dtypes:
            return math.nan
        return gemm_peak(dtype, weight_dtype=weight_dtype, reps=reps)

    return Machine(
        copy_bandwidth(),
        read_bandwidth(),
        peak("float32", torch.float32),
        peak("bfloat16", torch.bfloat16),
        peak("w8a8", torch.float32, "w8a8"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16,w8a8", help="the GEMM peaks to measure")
    ap.add_argument("--json", action="store_true", help="one JSON object (bench/roofline.py)")
    args = ap.parse_args()
    machine = measure_machine(tuple(args.dtypes.split(",")))
    if args.json:
        print(json.dumps(dataclasses.asdict(machine)))
        return
    print(f"read bandwidth {machine.read_bandwidth / 1e9:.1f} GB/s, copy "
          f"{machine.bandwidth / 1e9:.1f} GB/s; GEMM peak fp32 {machine.fp32_peak / 1e9:.0f}, "
          f"bf16 {machine.bf16_peak / 1e9:.0f} GFLOPS, w8a8 {machine.w8a8_peak / 1e9:.0f} GOPS")  # fmt: skip


if __name__ == "__main__":
    main()
