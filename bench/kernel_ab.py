"""One kernel at two revisions of kernels/csrc, timed in turn in one process.

    python bench/kernel_ab.py --base REV [--kernel packed_gemm] [--dtype float32]
                              [--rows 1,2,4,8,16,32,64] [--rounds 21] [--build avx512]
    python bench/kernel_ab.py --base REV --kernel paged_prefill [--rows 270,1024,2048]

Changes to a kernel that move it by a few percent (a prefetch distance, a tile) are smaller
than this host's drift between two runs of `bench/gemm.py` minutes apart. Here the kernel's
source at REV (`git show`) and in the working tree are each compiled, with the headers of
their own revision and the flags of one ISA build (kernels/cpu_build.py), into a module of
their own in this process; every round times both, one after the other, on the same
operands (which goes first alternates), so a slow spell of the machine falls on both.

Operands: one layer's projection shapes of `--model` (bench/linear.py), `--copies` copies
with weights of their own (by default enough to exceed 256 MiB, so that a few rows stream
the weights from memory, as a decode step does), packed as the engine packs them for the
kernel (rtp_serve/kernels/linear.py, w8a8.py). Both outputs are checked equal.
Per row count: GFLOPS (int8_gemm: GOPS) of each, the median over the rounds, the median of
the rounds' ratios, and the weights' GB/s of the new source.

`paged_prefill` (the attention of a new prompt): `--rows` are prompt lengths, and each is a
fresh prompt (nothing cached) of `--model`'s heads through each of its layers, every layer
with a KV cache of its own in `--dtype`, its blocks in order as a fresh prompt takes them.
GFLOPS count the causal half only (QK and PV: 4 x dim per visible pair); the last column
is then the cache's GB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent  # run as a script: the repository root first
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

from bench.linear import shapes  # noqa: E402
from rtp_serve.core.model_config import ModelConfig  # noqa: E402
from rtp_serve.kernels import cpu_build  # noqa: E402
from rtp_serve.kernels.isa import bench_flags, cpu_isa  # noqa: E402
from rtp_serve.kernels.linear import pack_panels  # noqa: E402
from rtp_serve.kernels.w8a8 import pack_vnni, quantize_int8, quantize_rows  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402
from rtp_serve.services.common.flags import DEFAULT_BLOCK_SIZE  # noqa: E402

CSRC = "kernels/csrc"
# Each kernel's entry point as kernels/csrc/module.cpp declares it.
DECLARATIONS = {
    "packed_gemm": "torch::Tensor packed_gemm(torch::Tensor x, torch::Tensor panels, int64_t N,"
    " c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias,"
    " c10::optional<torch::Tensor> residual);\nint64_t panel_width();",
    "rows_gemm": "torch::Tensor rows_gemm(torch::Tensor x, torch::Tensor w,"
    " c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias,"
    " c10::optional<torch::Tensor> residual);",
    "int8_gemm": "torch::Tensor int8_gemm(torch::Tensor xq, torch::Tensor x_scale,"
    " torch::Tensor panels, torch::Tensor w_sums, torch::Tensor w_scale, int64_t N,"
    " c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual);",
    "paged_prefill": "torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache,"
    " torch::Tensor v_cache, torch::Tensor block_table, int64_t ctx_len, int64_t block_size,"
    " double scale, c10::optional<torch::Tensor> k_scale,"
    " c10::optional<torch::Tensor> v_scale);",
}


def source_tree(rev: str | None, into: Path) -> Path:
    """kernels/csrc at git revision `rev` (None: the working tree) under `into`."""
    if rev is None:
        return _ROOT / CSRC
    names = subprocess.run(
        ["git", "-C", str(_ROOT), "ls-tree", "--name-only", f"{rev}:{CSRC}"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    for name in names:
        text = subprocess.run(
            ["git", "-C", str(_ROOT), "show", f"{rev}:{CSRC}/{name}"],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        (into / name).write_text(text)
    return into


def compile_kernel(kernel: str, src: Path, build: str, name: str, work: Path):
    """The kernel's source in `src`, with the headers beside it, as module `name`."""
    bind = work / f"{name}_bind.cpp"
    calls = [kernel] + (["panel_width"] if kernel == "packed_gemm" else [])
    defs = "\n".join(
        f'  m.def("{c}", &{c}, py::call_guard<py::gil_scoped_release>());' for c in calls
    )
    bind.write_text(
        f"#include <torch/extension.h>\n{DECLARATIONS[kernel]}\n"
        f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}\n}}\n"
    )
    return cpp_extension.load(
        name=name,
        sources=[str(src / f"{kernel}.cpp"), str(bind)],
        extra_cflags=cpu_build.flags(build),
        extra_ldflags=list(cpu_build.LINK_FLAGS),
        extra_include_paths=[str(src)],
        build_directory=str(work),
        verbose=False,
    )


def operands(kernel: str, module, dims: list[tuple[int, int]], copies: int, dtype):
    """Per copy and shape: (weight operand(s) as the kernel takes them, k, n)."""
    ops = []
    for _ in range(copies):
        for k, n in dims:
            w = torch.randn(n, k) / k**0.5
            if kernel == "int8_gemm":
                q, scale = quantize_int8(w)
                ops.append(((pack_vnni(q), q.sum(dim=1, dtype=torch.int32), scale), k, n))
            elif kernel == "packed_gemm":
                ops.append(((pack_panels(w.to(dtype), module.panel_width()),), k, n))
            else:
                ops.append(((w.to(dtype).contiguous(),), k, n))
    return ops


def call(kernel: str, module, x: dict, weights: tuple, k: int, n: int) -> torch.Tensor:
    if kernel == "int8_gemm":
        xq, xs = x[k]
        panels, sums, scale = weights
        return module.int8_gemm(xq, xs, panels, sums, scale, n, None, None)
    if kernel == "packed_gemm":
        return module.packed_gemm(x[k], weights[0], n, None, None, None)
    return module.rows_gemm(x[k], weights[0], None, None, None)


def prefill_case(cfg: ModelConfig, n: int, dtype: torch.dtype):
    """(run(module) -> outputs, FLOPs, cache bytes): a new n-token prompt through every layer."""
    blocks = -(-n // DEFAULT_BLOCK_SIZE)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layers = [
        (
            torch.randn(n, hq, d).to(dtype),
            torch.randn(blocks * DEFAULT_BLOCK_SIZE, hkv, d).to(dtype),
            torch.randn(blocks * DEFAULT_BLOCK_SIZE, hkv, d).to(dtype),
            torch.arange(blocks),
        )
        for _ in range(cfg.num_layers)
    ]

    def run(module):
        return [
            module.paged_prefill(q, k, v, table, 0, DEFAULT_BLOCK_SIZE, d**-0.5, None, None)
            for q, k, v, table in layers
        ]

    flops = cfg.num_layers * hq * n * (n + 1) / 2 * d * 4
    cache_bytes = sum(k.nbytes + v.nbytes for _, k, v, _ in layers)
    return run, flops, cache_bytes


def timed(run, base, new, rounds: int) -> tuple[float, float, float]:
    """Median seconds of base and new over the rounds, each first in every other round, and
    the median of the rounds' base / new."""
    times: dict[str, list[float]] = {"base": [], "new": []}
    for i in range(rounds):
        pair = (("base", base), ("new", new))
        for label, module in pair if i % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            run(module)
            times[label].append(time.perf_counter() - start)
    ratio = statistics.median(b / n for b, n in zip(times["base"], times["new"], strict=True))
    return statistics.median(times["base"]), statistics.median(times["new"]), ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--kernel", default="packed_gemm", choices=sorted(DECLARATIONS))
    ap.add_argument(
        "--dtype",
        default="float32",
        help="weights (packed_gemm, rows_gemm); paged_prefill: q and KV",
    )
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--rows", default=None,
                    help="rows of x (default 1,2,4,8,16,32,64); paged_prefill: prompt lengths "
                         "(default 270,1024,2048)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--copies", type=int, default=0, help="default: over 256 MiB of weights")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--build", default=None, help="avx2 or avx512 (default: this CPU's)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    isa = cpu_isa()
    build = args.build or cpu_build.build_for(isa.level)
    if build is None:
        sys.exit("no kernel build runs on this CPU (it lacks AVX2)")
    if args.kernel == "int8_gemm" and build != "avx512":
        sys.exit("int8_gemm is an AVX-512 VNNI kernel: --build avx512")
    dtype = getattr(torch, args.dtype)
    cfg = ModelConfig.from_dir(str(resolve_model(args.model)))
    prefill = args.kernel == "paged_prefill"
    rows = [
        int(r)
        for r in (args.rows or ("270,1024,2048" if prefill else "1,2,4,8,16,32,64")).split(",")
    ]

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "base").mkdir()
        tag = f"{os.getpid()}"
        base = compile_kernel(
            args.kernel, source_tree(args.base, work / "base"), build, f"ab_base_{tag}", work
        )
        new = compile_kernel(args.kernel, source_tree(None, work), build, f"ab_new_{tag}", work)
        print(f"cpu: {isa.describe()}; bench flags: {bench_flags()}; build {build}; "
              f"threads {args.threads}")  # fmt: skip
        if prefill:
            print(f"paged_prefill at {args.base} (base) against the working tree (new); "
                  f"{args.model}: {cfg.num_layers} layers of {cfg.num_heads} query and "
                  f"{cfg.num_kv_heads} kv heads of {cfg.head_dim}, {args.dtype} KV; a new "
                  f"prompt of M tokens; {args.rounds} rounds")  # fmt: skip

            def case(m: int):
                return prefill_case(cfg, m, dtype)
        else:
            dims = shapes(cfg)
            weight_bytes = 1 if args.kernel == "int8_gemm" else dtype.itemsize
            per_copy = sum(k * n for k, n in dims) * weight_bytes
            copies = args.copies or max(1, -(-(256 << 20) // per_copy))
            weights = operands(args.kernel, new, dims, copies, dtype)
            flops = sum(2 * k * n for _, k, n in weights)
            nbytes = sum(k * n for _, k, n in weights) * weight_bytes
            print(f"{args.kernel} at {args.base} (base) against the working tree (new); "
                  f"{args.model}: {len(dims)} shapes x {copies} copies, "
                  f"{nbytes / 2**20:.0f} MiB of "
                  f"{'int8' if args.kernel == 'int8_gemm' else args.dtype} weights; "
                  f"{args.rounds} rounds")  # fmt: skip

            def case(m: int):
                x = {k: torch.randn(m, k) for k in {k for k, _ in dims}}
                if args.kernel == "int8_gemm":
                    x = {k: quantize_rows(v, k) for k, v in x.items()}

                def run(module):
                    return [call(args.kernel, module, x, w, k, n) for w, k, n in weights]

                return run, m * flops, nbytes

        unit = "GOPS" if args.kernel == "int8_gemm" else "GFLOPS"
        print(f"{'M':>5} {'base ' + unit:>12} {'new ' + unit:>12} {'new/base':>9} "
              f"{'new GB/s':>9}")  # fmt: skip
        for m in rows:
            run, work_per_run, nbytes = case(m)
            check(run, base, new, args.kernel, m)
            t_base, t_new, ratio = timed(run, base, new, args.rounds)
            print(f"{m:>5} {work_per_run / t_base / 1e9:>12.1f} "
                  f"{work_per_run / t_new / 1e9:>12.1f} {ratio:>8.2f}x "
                  f"{nbytes / t_new / 1e9:>9.1f}")  # fmt: skip


def check(run, base, new, kernel: str, m: int) -> None:
    for a, b in zip(run(base), run(new), strict=True):
        if not torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-4):
            sys.exit(f"{kernel}: base and new disagree at {m} rows")


if __name__ == "__main__":
    main()
