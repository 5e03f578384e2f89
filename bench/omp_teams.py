"""One engine step on the thread that built the model, on another thread, and in AsyncLLM:
what a second OpenMP team in the process costs.

    python bench/omp_teams.py [--model llama-100m] [--prompt-len 270] [--rounds 3]

Each thread that runs a parallel region (torch's intra-op work, our kernels) keeps an
OpenMP team of its own. When the model is loaded on one thread and stepped on another, the
loader's team stays behind, idle; libgomp then counts more threads than cores and stops
spinning between regions, so every region of every step pays a wake-up. AsyncLLM builds
its engine on the engine thread for this reason (engine/async_llm.py). Per mode, a fresh
process times lone prefills of `--prompt-len` random tokens (one token out, prefix caching
off), median of 8 after 2 warm-ups:

  loader    LLM.generate on the thread that built the model (one team)
  second    the same LLM stepped from a second thread (two teams: the old AsyncLLM)
  async     AsyncLLM.generate (its engine built and stepped on the engine thread)

Rounds alternate the modes, so a noisy machine hits each alike. Wall-clock: compare
within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("loader", "second", "async")


def measure(mode: str, model: str, prompt_len: int, threads: int) -> float:
    """Median seconds of a lone prefill in `mode`, in this (fresh) process."""
    import random

    from rtp_serve.engine import LLM, AsyncLLM, EngineConfig, SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    kwargs = dict(num_threads=threads, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)

    def prompt() -> list[int]:
        return [rng.randrange(100, 8000) for _ in range(prompt_len)]

    times: list[float] = []
    if mode == "async":
        llm = AsyncLLM(EngineConfig(model=model, **kwargs))

        async def run() -> None:
            for i in range(10):
                t0 = time.perf_counter()
                async for _ in llm.generate(prompt(), params):
                    pass
                if i >= 2:
                    times.append(time.perf_counter() - t0)

        asyncio.run(run())
        llm.shutdown()
        return statistics.median(times)

    sync = LLM(model, **kwargs)

    def run_sync() -> None:
        for i in range(10):
            t0 = time.perf_counter()
            sync.generate([prompt()], params)
            if i >= 2:
                times.append(time.perf_counter() - t0)

    if mode == "loader":
        run_sync()
    else:
        thread = threading.Thread(target=run_sync)
        thread.start()
        thread.join()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--prompt-len", type=int, default=270)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one measurement
    args = ap.parse_args()
    from rtp_serve.models.make_model import resolve_model

    model = str(resolve_model(args.model))
    if args.mode:
        print(json.dumps(measure(args.mode, model, args.prompt_len, args.threads)))
        return

    from rtp_serve.kernels.isa import bench_flags, cpu_isa

    print(f"cpu: {cpu_isa().describe()}; bench flags: {bench_flags()}; threads {args.threads}")
    print(f"model {args.model}, lone prefill of {args.prompt_len} tokens, ms (median of 8)")
    got: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, __file__, "--mode", mode, "--model", model,
                 "--prompt-len", str(args.prompt_len), "--threads", str(args.threads)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            got[mode].append(json.loads(out.stdout.strip().splitlines()[-1]) * 1e3)
    base = statistics.median(got["loader"])
    print(f"{'mode':>7} {'median':>7}  {'/loader':>7}  rounds")
    for mode, values in got.items():
        med = statistics.median(values)
        rounds = " ".join(f"{v:.0f}" for v in values)
        print(f"{mode:>7} {med:7.0f}  {med / base:7.2f}x  {rounds}")


if __name__ == "__main__":
    main()
