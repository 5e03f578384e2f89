"""The GEMM efficiency curve: GFLOPS at each row count on one model's projection shapes,
every path the engine has against torch.mm (MKL), beside the machine's measured peak.

    python bench/gemm.py [--model llama-100m] [--threads 2] [--rows 1,2,4,...,1024]

Header: the CPU flags, the threads, and two ceilings measured in this run:
  FMA limit    kernels/csrc/fma_peak.cpp: independent FMA chains in registers, no memory:
               what no GEMM can exceed; divided by (2 FMA pipes x the build's fp32 lanes, 8 on
               AVX2 and 16 on AVX-512, x 2 FLOPs x threads) it gives the clock the cores
               ran at if they have two FMA pipes of that width (AVX2: two 256-bit FMA pipes
               on the Zen and Intel cores measured here; AMD Zen 4 splits each AVX-512 FMA
               into two 256-bit halves, so there the clock is twice what that gives)
  GEMM peak    the best of MKL (torch.mm), oneDNN (torch's mkldnn linear) and packed_gemm
               on large GEMMs (2048 x 2048 x 2048, and the model's largest shape at 256,
               1024 and 2048 rows)

Per row count M: one layer's projections (q/k/v, o, gate/up, down, the LM head once per
`--layers`) as the engine holds them (rtp_serve/kernels/linear.py), `--layers` copies with
their own weights so that small M streams them from memory as a decode step does. Columns:
GFLOPS of the op as tuned (its KernelTable's pick, `gemm_table.tune`), of each path forced
(oneDNN's prepacked fp32 where it runs here),
and of torch.mm on the same weights; then the tuned op as % of the GEMM peak and the floor
arithmetic: the step's FLOPs at the peak vs its weight bytes at the read bandwidth
(bench/ceilings.py).
Wall-clock on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent  # run as a script: the repository root first
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import torch  # noqa: E402

from bench.ceilings import best_seconds, copy_bandwidth, read_bandwidth  # noqa: E402
from bench.linear import shapes  # noqa: E402
from rtp_serve.core.model_config import ModelConfig  # noqa: E402
from rtp_serve.kernels import cpu  # noqa: E402
from rtp_serve.kernels.isa import bench_flags, cpu_isa  # noqa: E402
from rtp_serve.kernels.linear import Fp32Linear, cpu_kernels, tune_linears  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402

PATHS = ("rows_gemm", "packed_gemm", "mkl", "onednn")  # onednn: where prepack_fp32 works


def gemm_peak(ops, big_shape: tuple[int, int]) -> dict[str, float]:
    """GFLOPS of each library on large GEMMs; the best over the shapes, per library."""
    g = torch.Generator().manual_seed(0)
    k, n = big_shape
    out: dict[str, float] = {}
    for m_, k_, n_ in ((2048, 2048, 2048), (256, k, n), (1024, k, n), (2048, k, n)):
        x, w = torch.randn(m_, k_, generator=g), torch.randn(n_, k_, generator=g)
        wt = w.t().contiguous()
        flops = 2 * m_ * k_ * n_
        cands = {"MKL torch.mm": lambda x=x, wt=wt: torch.mm(x, wt)}
        mkldnn = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
        if mkldnn is not None and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                mkldnn(x, packed, None, "none", [], "")
                cands["oneDNN linear"] = lambda x=x, p=packed, f=mkldnn: f(
                    x, p, None, "none", [], ""
                )
            except Exception:  # no fp32 prepack in this torch build: not a candidate
                pass
        if ops is not None:
            op = Fp32Linear(w, cpu_kernels(torch.device("cpu")))
            cands["packed_gemm"] = lambda x=x, op=op: op.paths()["packed_gemm"](x)
        for name, fn in cands.items():
            out[name] = max(out.get(name, 0.0), flops / best_seconds(fn, 5) / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--layers", type=int, default=4, help="weight copies (streamed at small M)")
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48,64,128,256,1024")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu.load()
    if ops is None:
        sys.exit("no compiled CPU kernels here (RTP_SERVE_ISA=scalar?): nothing to compare")
    cfg = ModelConfig.from_dir(resolve_model(args.model))
    kernels = cpu_kernels(torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    layer = [*shapes(cfg), (cfg.hidden_size, cfg.vocab_size)]
    weights = [
        torch.randn(n, k, generator=g) / k**0.5 for _ in range(args.layers) for k, n in layer
    ]
    linears = [Fp32Linear(w, kernels) for w in weights]  # tuned: packed dropped where unused
    forced = [Fp32Linear(w, kernels) for w in weights]  # every path kept, each timed alone
    t0 = time.perf_counter()
    tune_linears(linears, cache=False)
    tune_s = time.perf_counter() - t0

    fma = statistics.median(ops.fma_peak_gflops(30_000_000) for _ in range(3))
    peaks = gemm_peak(ops, max(layer, key=lambda s: s[0] * s[1]))
    peak = max(peaks.values())
    bandwidth = read_bandwidth() / 1e9
    nbytes = sum(w.numel() * 4 for w in weights)
    flops_per_row = 2 * sum(w.numel() for w in weights)

    print(f"cpu: {cpu_isa().describe()}; bench flags: {bench_flags()}; threads {args.threads}")
    print(f"model {args.model}: {len(layer)} shapes (k x n) {layer}, x{args.layers} copies, "
          f"{nbytes / 2**20:.0f} MiB fp32; tables measured in {tune_s:.1f} s")  # fmt: skip
    per_cycle = 2 * ops.vector_lanes() * 2  # 2 FMA pipes x the build's fp32 lanes x 2 FLOPs
    ghz = fma / per_cycle / args.threads
    split = ""  # AMD Zen 4 runs a 512-bit FMA as two 256-bit halves: half the FLOP a cycle
    if ops.vector_lanes() == 16:
        split = f" (or {2 * ghz:.2f} GHz x {per_cycle // 2}, where AVX-512 runs as two halves)"
    print(f"FMA limit (measured in registers): {fma:.0f} GFLOPS = {ghz:.2f} GHz"
          f" x {per_cycle} FLOP/cycle x {args.threads} cores{split}")  # fmt: skip
    print("GEMM peak (large GEMMs): " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items())
          + f" GFLOPS -> peak {peak:.0f} ({100 * peak / fma:.0f}% of the FMA limit)")  # fmt: skip
    print(f"read bandwidth: {bandwidth:.1f} GB/s (a copy moves {copy_bandwidth() / 1e9:.1f})")
    for op, (k, n) in zip(linears[: len(layer)], layer, strict=True):
        print(f"  table {k}x{n}: {op.table.describe()}")
    print()
    print(f"{'M':>5} {'tuned':>7} {'rows_gemm':>9} {'packed':>7} {'mkl':>7} {'onednn':>7} {'torch.mm':>8} "
          f"{'tuned/mm':>8} {'% peak':>6} {'floor ms':>8} {'tuned ms':>8}  floor by")  # fmt: skip
    mm_ws = [w.t().contiguous() for w in weights]  # torch.mm's own [k, n] layout
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=g) for k in {k for k, _ in layer}}
        flops = flops_per_row * m
        fns = {
            "tuned": lambda xs=xs: [op(xs[op.w.shape[1]]) for op in linears],
            **{
                p: (lambda xs=xs, p=p: [op.paths()[p](xs[op.w.shape[1]]) for op in forced])
                for p in PATHS
                if p in forced[0].paths() and (m <= 256 or p != "rows_gemm")
            },
            "torch.mm": lambda xs=xs, ws=mm_ws: [torch.mm(xs[w.shape[0]], w) for w in ws],
        }
        gf = {name: flops / best_seconds(fn, args.repeats) / 1e9 for name, fn in fns.items()}
        floor_s = max(flops / (peak * 1e9), nbytes / (bandwidth * 1e9))
        by = "FLOPs" if flops / (peak * 1e9) >= nbytes / (bandwidth * 1e9) else "bytes"

        def cell(name: str, gf=gf) -> str:
            return f"{gf[name]:.1f}" if name in gf else "-"

        print(f"{m:>5} {cell('tuned'):>7} {cell('rows_gemm'):>9} {cell('packed_gemm'):>7} "
              f"{cell('mkl'):>7} {cell('onednn'):>7} {cell('torch.mm'):>8} {gf['tuned'] / gf['torch.mm']:>7.2f}x "
              f"{100 * gf['tuned'] / peak:>5.0f}% {floor_s * 1e3:>8.2f} {flops / gf['tuned'] / 1e6:>8.2f}  {by}")  # fmt: skip


if __name__ == "__main__":
    main()
