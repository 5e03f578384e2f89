"""Projections at decode sizes: the checkpoint's [out, in] layout (what the engine keeps, so
a mapped weight is used where it lies) against the transposed [in, out] copy the engine used
to make at load, and MKL; with --dtype, weights stored narrower against torch's own GEMM.

    python bench/linear.py [--model llama-1b] [--layers 6] [--rows 1,2,3,4,8,16,32] [--threads N]
    python bench/linear.py --dtype bfloat16|float16|int8

One model's projection shapes (q/k/v, o, gate/up, down), `--layers` copies of each with
random weights, so the weights stream from memory as in a decode step (more than the last
level cache), each called with `--rows` rows of x:

  rows_gemm [out,in]   kernels/csrc/rows_gemm.cpp, the engine's path (Fp32Linear)
  small_gemm [in,out]  kernels/csrc/small_gemm.cpp over a transposed copy: the baseline
  F.linear [out,in]    MKL sgemm, what serves more rows than kernels.linear.SMALL_M

Printed: the median milliseconds (the three called in turn) for all of them and the weight
bytes streamed per second, the ratio baseline / ours (above 1: ours faster). Header: the CPU
flags and the build that ran.

--dtype: the same shapes stored in bfloat16, float16 or int8 (per output channel, a float32
scale), three ways, called in turn:

  rows_gemm <dtype>    the engine's path (RowsLinear): widened to float32 as it streams
  torch <dtype>        what serves them without it: F.linear in that dtype (oneDNN's bf16
                       GEMM on AVX512-BF16 CPUs), int8 dequantized first
  rows_gemm float32    the same projections stored in float32 (twice or 4x the bytes)
  oneDNN packed        bfloat16 on CPUs where kernels.linear.prepack_works(): the prepacked
                       GEMM RowsLinear uses from PACKED_FROM rows
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

from rtp_serve.core.model_config import ModelConfig  # noqa: E402
from rtp_serve.kernels import cpu  # noqa: E402
from rtp_serve.kernels.isa import cpu_isa  # noqa: E402
from rtp_serve.kernels.linear import Kernels, RowsLinear, prepack_works, quantize_int8  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402


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
    ap.add_argument("--dtype", default="float32", choices=["float32", *NARROW])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu.load()
    if ops is None:
        sys.exit("no compiled CPU kernels here (RTP_SERVE_ISA=scalar?): nothing to compare")
    print(f"cpu: {cpu_isa().describe()}; threads {args.threads}")
    cfg = ModelConfig.from_dir(resolve_model(args.model))
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) for _ in range(args.layers) for k, n in shapes(cfg)]
    if args.dtype != "float32":
        narrow(ops, ws, args, g)
        return
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


NARROW = {"bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def narrow(ops, ws: list[torch.Tensor], args, g: torch.Generator) -> None:
    """The --dtype table: rows_gemm over the narrow weights, torch over them, and
    rows_gemm over float32."""
    dtype = NARROW[args.dtype]
    if dtype == torch.int8:
        stored = [quantize_int8(w) for w in ws]
    else:
        stored = [(w.to(dtype), None) for w in ws]
    gib = sum(w.numel() * w.element_size() for w, _ in stored) / 2**30
    packed = None  # the engine's op on the prepacked path alone (no rows_gemm to take rows)
    if dtype == torch.bfloat16 and prepack_works():
        only_packed = Kernels(ops=None, prepack_bf16=True)
        packed = [RowsLinear(w, dtype, only_packed) for w, _ in stored]
    print(f"{args.model}: {len(ws)} projections, {gib:.2f} GiB of {args.dtype} weights")
    print(f"{'rows':>4} {'rows_gemm ms':>13} {'GiB/s':>6} {'torch ms':>9} {'fp32 rows_gemm ms':>18} "
          f"{'torch/rows':>10}" + (f" {'oneDNN packed ms':>17}" if packed else ""))  # fmt: skip

    def torch_path(x: torch.Tensor) -> list[torch.Tensor]:
        if dtype == torch.int8:  # dequantized, then float32
            return [F.linear(x[w.shape[1]], w.float() * s[:, None]) for w, s in stored]
        return [F.linear(x[w.shape[1]].to(dtype), w) for w, _ in stored]

    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=g) for k in {w.shape[1] for w in ws}}
        fns = [
            lambda xs=xs: [ops.rows_gemm(xs[w.shape[1]], w, s, None, None) for w, s in stored],
            lambda xs=xs: torch_path(xs),
            lambda xs=xs: [ops.rows_gemm(xs[w.shape[1]], w, None, None, None) for w in ws],
        ]
        if packed:
            xb = {k: x.bfloat16() for k, x in xs.items()}
            fns.append(lambda xb=xb: [op(xb[op.w.shape[1]]) for op in packed])
        ours, base, f32, *onednn = timed(fns, args.repeats)
        print(f"{m:>4} {ours * 1e3:>13.1f} {gib / ours:>6.1f} {base * 1e3:>9.1f} {f32 * 1e3:>18.1f} "
              f"{base / ours:>9.2f}x" + (f" {onednn[0] * 1e3:>17.1f}" if onednn else ""))  # fmt: skip


if __name__ == "__main__":
    main()
