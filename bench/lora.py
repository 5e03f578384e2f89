"""Multi-LoRA benchmark: a batch where every row has its own adapter vs all rows on the base.

    python bench/lora.py [--model llama-100m] [--adapters 8] [--rank 16] [--batch 8]
                         [--prompt-len 64] [--new-tokens 64] [--dtype float32] [--threads N]

Header: the CPU flags that pick kernels. Then, on one engine with `--adapters` random
adapters resident (all of q/k/v/o/gate/up/down), the same `--batch` prompts submitted
together twice: every row on the base model, and row i on adapter i % adapters. Printed
side by side: decode tokens/s (the steady state: output tokens after the first over the
time after every row has its first token), end-to-end output tokens/s, and their ratio
(target >= 0.8x). Last, one layer's LoRA updates at decode size by the ways of batching
them: the compiled `lora_rows` kernel the engine uses for decode rows on the CPU kernels
(float32), the masked GEMMs over the stacked adapters it uses without them
(engine/lora/stacked.py), the per-adapter runs it uses for prefill chunks
(engine/lora/batch.py), and a gathered per-row A/B (a bmm over [rows, in, R] copies). Wall-clock on a shared machine: compare within one
run.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path: its siblings would shadow.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from rtp_serve.engine import LLM, SamplingParams  # noqa: E402
from rtp_serve.engine.lora.batch import LoraBatch  # noqa: E402
from rtp_serve.engine.lora.weights import DOWN, GATE_UP, OUT, QKV  # noqa: E402
from rtp_serve.models.make_adapter import build_adapter  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402

FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512f", "avx2")


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text()
    return " ".join(sorted(f for f in FLAGS if re.search(rf"\b{f}\b", text)))


def run(llm: LLM, prompts, loras, new_tokens: int) -> tuple[float, float]:
    """(decode tok/s, end-to-end output tok/s) of one batch submitted together."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [
        engine.make_request(f"r{i}-{time.monotonic_ns()}", p, params, lora=name)
        for i, (p, name) in enumerate(zip(prompts, loras, strict=True))
    ]
    start = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    first_all = None
    done, produced = 0, 0
    while done < len(reqs):
        for out in engine.step():
            produced += len(out.new_token_ids)
            done += out.finished
        if first_all is None and all(r.num_output_tokens >= 1 for r in reqs):
            first_all, produced_at_first = time.perf_counter(), produced
    end = time.perf_counter()
    decode = (produced - produced_at_first) / (end - first_all)
    return decode, produced / (end - start)


def apply_micro(llm: LLM, names: list[str], reps: int = 100) -> dict[str, float]:
    """Microseconds of one layer's four updates for len(names) decode rows, three ways:
    the engine's stacked pass, the engine's per-adapter runs, and a gathered per-row A/B
    (a bmm over per-row copies of the qkv A and B, extrapolated to the four projections)."""
    registry = llm.engine.loras
    resident = registry.activate(set(names))
    cfg = llm.engine.model_config
    dtype = llm.engine.runner.dtype
    rows = len(names)
    fan = {
        QKV: (cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim),
        OUT: (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
        GATE_UP: (cfg.hidden_size, 2 * cfg.intermediate_size),
        DOWN: (cfg.intermediate_size, cfg.hidden_size),
    }
    xs = {p: torch.randn(rows, i, dtype=dtype) for p, (i, _) in fan.items()}
    ys = {p: torch.zeros(rows, o, dtype=dtype) for p, (_, o) in fan.items()}
    ops = llm.engine.runner._lora_ops  # the engine's kernels for decode-sized updates
    decode = [(1, n, False) for n in names]
    kernel = LoraBatch.of_rows(decode, resident, registry.stacked, dtype, ops)
    masked = LoraBatch.of_rows(decode, resident, registry.stacked, dtype, replace(ops, rows=None))
    runs = LoraBatch.of_rows([(1, n, True) for n in names], resident, registry.stacked, dtype, ops)
    pairs = [resident[n].layers[0][QKV] for n in names]
    a = torch.stack([p.a for p in pairs])  # [rows, in, R]
    b = torch.zeros(rows, a.shape[2], fan[QKV][1], dtype=dtype)
    for i, p in enumerate(pairs):
        for part in p.parts:
            b[i, part.rows, part.cols] = part.b

    def batched(batch: LoraBatch):
        def fn():
            for p in fan:
                batch.add(0, p, xs[p], ys[p])

        return fn

    def gathered():
        slot = torch.arange(rows)
        for _ in fan:  # the qkv shapes four times: a lower bound of the real cost
            t = torch.bmm(xs[QKV].unsqueeze(1), a.index_select(0, slot))
            ys[QKV].add_(torch.bmm(t, b.index_select(0, slot)).squeeze(1))

    timings = {}
    cases = {"masked": batched(masked), "runs": batched(runs), "gather": gathered}
    if ops.rows is not None:
        cases["kernel"] = batched(kernel)
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        timings[name] = (time.perf_counter() - t0) / reps * 1e6
    return timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="alternate the two runs this often")
    args = ap.parse_args()

    model = resolve_model(args.model)
    print(f"cpu flags: {cpu_flags()}")
    print(f"torch threads: {args.threads or torch.get_num_threads()}")
    tmp = tempfile.TemporaryDirectory()  # until exit: the engine may reload from it
    loras = tuple(
        (f"lora{i}", str(build_adapter(str(model), Path(tmp.name) / f"l{i}", args.rank, seed=i)))
        for i in range(args.adapters)
    )
    llm = LLM(
        str(model),
        dtype=args.dtype,
        loras=loras,
        max_loras=args.adapters,
        num_threads=args.threads,
        enable_prefix_caching=False,
    )
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)
    ]
    cases = {
        "base": [""] * args.batch,
        f"{args.adapters} adapters": [loras[i % args.adapters][0] for i in range(args.batch)],
    }
    run(llm, prompts[:2], ["", loras[0][0]], 4)  # warm up both paths
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, names in cases.items():
            results[name].append(run(llm, prompts, names, args.new_tokens))
    best = {k: (max(d for d, _ in v), max(e for _, e in v)) for k, v in results.items()}
    print(
        f"model {Path(model).name} {args.dtype}, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, rank {args.rank} on q,k,v,o,gate,up,down "
        f"(best of {args.repeats})"
    )
    print(f"{'case':<14}{'decode tok/s':>14}{'e2e tok/s':>12}{'x base':>9}")
    base = best["base"]
    for name, (dec, e2e) in best.items():
        print(f"{name:<14}{dec:>14.1f}{e2e:>12.1f}{dec / base[0]:>8.2f}x")
    micro = apply_micro(llm, cases[f"{args.adapters} adapters"])
    print(
        f"one layer's updates, {args.batch} decode rows: "
        + (f"lora_rows kernel {micro['kernel']:.0f} us, " if "kernel" in micro else "")
        + f"masked stacked GEMMs {micro['masked']:.0f} us, "
        f"per-adapter runs {micro['runs']:.0f} us, gathered per-row bmm {micro['gather']:.0f} us"
    )


if __name__ == "__main__":
    main()
