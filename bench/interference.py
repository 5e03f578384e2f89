"""What a little work beside the engine costs its decode: tokens/s alone, then beside a
competitor process that uses `--busy` of one core in short bursts (as a frontend, a master or
a worker's own event loop do on the same cores).

    python bench/interference.py [--model llama-100m] [--batch 16] [--busy 0.05] [--rounds 3]

Each step's parallel regions end when their slowest thread does: with a static split, a
thread the OS stops for a burst holds up its whole share, and the others wait for it. The
kernels hand their work out in chunks the threads take in turn (kernels/csrc/parallel.h), so
that the others take a stopped thread's share. Rounds alternate alone and beside; the ratio
of their medians is the cost. Wall-clock on a shared machine: compare within one run (or
build the other kernels and run it again beside).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BURST_S = 0.0005  # each burst of the competitor


def competitor(stop, busy: float) -> None:
    period = BURST_S / busy
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < BURST_S:
            pass
        time.sleep(period - BURST_S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="decoded per request")
    ap.add_argument("--busy", type=float, default=0.05, help="the competitor's share of a core")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from rtp_serve.core.sampling_params import SamplingParams
    from rtp_serve.engine.llm import LLM
    from rtp_serve.kernels.isa import bench_flags, cpu_isa
    from rtp_serve.models.make_model import resolve_model

    llm = LLM(str(resolve_model(args.model)), enable_prefix_caching=False)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

    def tokens_per_s() -> float:
        prompts = [[rng.randrange(10, 8000) for _ in range(32)] for _ in range(args.batch)]
        t = time.perf_counter()
        llm.generate(prompts, params)
        return args.batch * args.tokens / (time.perf_counter() - t)

    print(f"cpu: {cpu_isa().describe()}; bench flags: {bench_flags()}")
    print(f"{args.model}, {args.batch} requests x {args.tokens} tokens decoded, 32-token "
          f"prompts; competitor: {args.busy:.0%} of a core in {BURST_S * 1e3:.1f} ms bursts")  # fmt: skip
    tokens_per_s()  # warm-up
    alone, beside = [], []
    for i in range(args.rounds):
        alone.append(tokens_per_s())
        stop = mp.Event()
        proc = mp.Process(target=competitor, args=(stop, args.busy), daemon=True)
        proc.start()
        beside.append(tokens_per_s())
        stop.set()
        proc.join()
        print(f"  round {i}: alone {alone[-1]:6.1f} tok/s, beside {beside[-1]:6.1f}")
    a, b = statistics.median(alone), statistics.median(beside)
    cores = len(os.sched_getaffinity(0))
    print(f"median: alone {a:.1f} tok/s, beside {b:.1f} ({b / a:.3f}x; the competitor's own "
          f"share of the {cores} cores alone would make it {1 - args.busy / cores:.3f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
