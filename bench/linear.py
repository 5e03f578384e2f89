"""Float32 projections at decode sizes: the checkpoint's [out, in] layout (what the engine
keeps, so a mapped weight is used where it lies) against the transposed [in, out] copy the
engine used to make at load, and MKL.

    python bench/linear.py [--model llama-1b] [--layers 6] [--rows 1,2,3,4,8,16,32] [--threads N]

One model's projection shapes (q/k/v, o, gate/up, down), `--layers` copies of each with
random weights, so the weights stream from memory as in a decode step (more than the last
level cache), each called with `--rows` rows of x:

  rows_gemm [out,in]   kernels/csrc/rows_gemm.cpp, the engine's path (Fp32Linear)
  small_gemm [in,out]  kernels/csrc/small_gemm.cpp over a transposed copy: the baseline
  F.linear [out,in]    MKL sgemm, what serves more rows than kernels.linear.SMALL_M

Printed: the median milliseconds (the three called in turn) for all of them and the weight bytes streamed per second, the ratio
baseline / ours (above 1: ours faster). Header: the CPU flags and the build that ran.
Wall-clock on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent  # run as a script: the repository root first
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.make_model import resolve_model  # noqa: E402
from kernels import cpu  # noqa: E402
from kernels.isa import cpu_isa  # noqa: E402


def shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one layer's projections."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    return [
        (h, qkv),
        (cfg.num_heads * d, h),
        (h, 2 * cfg.intermediate_size),
        (cfg.intermediate_size, h),
    ]


def timed(fns: list, repeats: int) -> list[float]:
    """The median seconds of each of `fns`, called in turn `repeats` times (interleaved, so
    a slow spell of the shared machine falls on all of them)."""
    samples: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, times in zip(fns, samples, strict=True):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in samples]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rows", default="1,2,3,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu.load()
    if ops is None:
        sys.exit("no compiled CPU kernels here (RTP_SERVE_ISA=scalar?): nothing to compare")
    print(f"cpu: {cpu_isa().describe()}; threads {args.threads}")
    cfg = ModelConfig.from_dir(resolve_model(args.model))
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) for _ in range(args.layers) for k, n in shapes(cfg)]
    wts = [w.t().contiguous() for w in ws]
    gib = sum(w.numel() * 4 for w in ws) / 2**30
    print(f"{args.model}: {len(ws)} projections, {gib:.2f} GiB of float32 weights")
    print(f"{'rows':>4} {'rows_gemm ms':>13} {'GiB/s':>6} {'small_gemm ms':>14} {'GiB/s':>6} "
          f"{'F.linear ms':>12} {'small/rows':>10}")  # fmt: skip
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=g) for k in {w.shape[1] for w in ws}}
        ours, base, mkl = timed(
            [
                lambda xs=xs: [ops.rows_gemm(xs[w.shape[1]], w, None, None, None) for w in ws],
                lambda xs=xs: [ops.small_gemm(xs[w.shape[0]], w, None, None) for w in wts],
                lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in ws],
            ],
            args.repeats,
        )
        print(f"{m:>4} {ours * 1e3:>13.1f} {gib / ours:>6.1f} {base * 1e3:>14.1f} {gib / base:>6.1f} "
              f"{mkl * 1e3:>12.1f} {base / ours:>9.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
