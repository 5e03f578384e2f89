"""Fit the simulated worker's step-time profile on the real engine, on this machine.

    python bench/fit_sim.py --model smollm2-135m --threads 1 --out sim_cost.json

Runs the real engine (LLMEngine) on scripted workloads, times every step, reads what each
step computed from the requests' state (prompt tokens and the context they attended to;
decode rows and their summed context), and fits rtp_serve/core/sim_cost.py's formula by
non-negative least squares (core/cost_model.py's LinearFit, without forgetting). Prints the
fit and its error per workload kind beside the CPU flags; writes the JSON that
`rtp-serve sim-worker --cost` loads. The machine is shared: steps timed while other work
runs are slower, and the fit says so only through its error column.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from rtp_serve.core.cost_model import LinearFit  # noqa: E402
from rtp_serve.core.sampling_params import SamplingParams  # noqa: E402
from rtp_serve.core.sim_cost import SimCost  # noqa: E402
from rtp_serve.engine.config import EngineConfig  # noqa: E402
from rtp_serve.engine.llm_engine import LLMEngine  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402


@dataclass(frozen=True, slots=True)
class Sample:
    kind: str  # "prefill" | "decode" | "mixed"
    prefill_tokens: int
    prefill_ctx: float  # mean context a prompt token attended to
    decode_rows: int
    decode_ctx: int
    seconds: float

    def features(self) -> tuple[float, ...]:
        p = self.prefill_tokens
        return (1.0, p, p * self.prefill_ctx / 1000, self.decode_rows, self.decode_ctx / 1000)


def cpu_flags() -> str:
    from rtp_serve.kernels.isa import bench_flags

    return bench_flags()


def run_steps(engine: LLMEngine, kind: str, samples: list[Sample]) -> None:
    """Step until every request finished, recording each step's work and time."""
    while engine.has_unfinished_requests():
        before = {
            rid: (r.num_computed_tokens, r.num_prompt_tokens)
            for rid, r in engine.scheduler.requests.items()
        }
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        p = rows = dctx = 0
        attended = 0.0
        for rid, (computed, prompt) in before.items():
            r = engine.scheduler.requests.get(rid)
            after = r.num_computed_tokens if r is not None else None
            if after is None:  # finished this step: the rest of its prompt, or one token
                after = max(prompt, computed + 1)
            n = after - computed
            if n <= 0:
                continue
            if computed < prompt:
                p += n
                attended += n * (computed + n / 2)
            else:
                rows += 1
                dctx += after
        if p or rows:
            kind_now = kind if not (p and rows) else "mixed"
            samples.append(Sample(kind_now, p, attended / p if p else 0.0, rows, dctx, seconds))


def prefill_workloads(engine: LLMEngine, vocab: int, samples: list[Sample], seed: int) -> None:
    """One prompt at a time, of lengths up to the budget and past it (chunked)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i, length in enumerate((32, 128, 256, 512, 1024, 2048, 3072, 4096)):
        prompt = [(seed + i * 7919 + t * 31) % vocab for t in range(length)]
        engine.add_request(engine.make_request(f"p{seed}-{i}", prompt, params))
        run_steps(engine, "prefill", samples)


def decode_workloads(engine: LLMEngine, vocab: int, samples: list[Sample], seed: int) -> None:
    """Batches of r requests decoding at context L."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for rows in (1, 4, 16, 32):
        for length in (64, 512, 1536):
            for j in range(rows):
                # Every prompt its own (no prefix shared with another batch's: a cached
                # prefix would count as computed in the step that admits it).
                first = seed + (rows * 1000 + j) * 104729 + length
                prompt = [(first + t * 17) % vocab for t in range(length)]
                rid = f"d{seed}-{rows}-{length}-{j}"
                engine.add_request(engine.make_request(rid, prompt, params))
            run_steps(engine, "decode", samples)


def fit(samples: list[Sample]) -> tuple[float, ...]:
    """Least relative error: each step's equation divided by its own time, so a 10 ms
    decode step weighs as much as a 1 s prefill chunk."""
    lf = LinearFit(5, half_life=1e12)
    for s in samples:
        lf.observe([f / s.seconds for f in s.features()], 1.0)
    return lf.coefficients()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model dir or preset name")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's)")
    ap.add_argument("--kv-cache-mib", type=int, default=3072)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2, help="repetitions of each workload")
    ap.add_argument("--out", default="sim_cost.json")
    ap.add_argument("--samples", default=None, help="keep the timed steps here (JSON lines)")
    ap.add_argument("--from-samples", default=None, help="refit steps kept before; no engine")
    args = ap.parse_args(argv)
    if args.from_samples:
        lines = Path(args.from_samples).read_text().splitlines()
        samples = [Sample(**json.loads(line)) for line in lines]
        report(fit(samples), samples, f"refit of {args.from_samples}", args.out)
        return
    torch.set_num_threads(args.threads)
    model = str(resolve_model(args.model))
    config = EngineConfig(
        model=model,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=64,
    )
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    samples: list[Sample] = []
    started = time.monotonic()
    for r in range(args.rounds):
        prefill_workloads(engine, vocab, samples, seed=1000 * r + 1)
        decode_workloads(engine, vocab, samples, seed=1000 * r + 2)
    if args.samples:
        with Path(args.samples).open("w") as f:
            f.writelines(json.dumps(asdict(s)) + "\n" for s in samples)
    print(f"# {len(samples)} steps timed in {time.monotonic() - started:.0f} s")
    source = (
        f"bench/fit_sim.py on {platform.node()} ({cpu_flags()}), {Path(model).name}, "
        f"{config.dtype}, torch threads {args.threads}, {len(samples)} steps"
    )
    report(fit(samples), samples, source, args.out)


def report(coefficients: tuple[float, ...], samples: list[Sample], source: str, out: str) -> None:
    fixed, token, attn, row, ctx = coefficients
    cost = SimCost(fixed, token, attn, row, ctx, source=source)
    cost.save(out)
    print(f"# cpu flags: {cpu_flags()} (shared machine: noisy)")
    print(f"# fixed_s {fixed:.3e}  prefill_token_s {token:.3e}  prefill_attn_s {attn:.3e}  "
          f"decode_row_s {row:.3e}  decode_ctx_s {ctx:.3e}")  # fmt: skip
    print("| kind | steps | median measured ms | median predicted ms | median abs error % |")
    print("|---|---|---|---|---|")
    for kind in ("prefill", "decode", "mixed"):
        mine = [s for s in samples if s.kind == kind]
        if not mine:
            continue
        predicted = [
            cost.step_s(s.prefill_tokens, s.prefill_ctx, s.decode_rows, s.decode_ctx) for s in mine
        ]
        errors = [
            abs(p - s.seconds) / s.seconds * 100 for p, s in zip(predicted, mine, strict=True)
        ]
        print(f"| {kind} | {len(mine)} | {statistics.median(s.seconds for s in mine) * 1e3:.2f} | "
              f"{statistics.median(predicted) * 1e3:.2f} | {statistics.median(errors):.0f} |")  # fmt: skip
    print(f"# written to {out}")


if __name__ == "__main__":
    main()
