"""The SLA planner against static provisioning, over a day of load compressed to minutes.

    python bench/planner.py --day-s 240 --cost bench/profiles/smollm2-135m-avx2-1thread.json \
        --png planner.png [--policies holt,last,static-peak,static-mean]

Real NATS, nameservice, master and frontend; simulated workers (`rtp-serve sim-worker`,
stepping by a cost profile fitted on this machine, bench/fit_sim.py). The load: the
Mooncake trace's requests (real token lengths, 512 tokens per hash id, cut at --max-input
and --max-output) arriving as a Poisson process whose rate follows a day

    rate(t) = peak * (0.55 - 0.45 * cos(2 pi t / day))       night 0.1 x peak, noon 1 x
            * 5 over [burst_at, burst_at + burst_len]          the burst

(the same arrival times, seed and requests for every policy). Policies:

    holt, last     the planner (--predictor), local actuator, --min-workers 1
    static-peak    the fewest fused workers the planner's own arithmetic says meet the
                   targets at the burst's rate; static-mean the same at the day's mean rate

Per policy: the share of windows (--window-s of wall time; the day is --day-s) meeting both
targets (TTFT p95 and ITL p95 of the requests that arrived in it; a window without requests
meets them), worker-seconds (workers registered, sampled every 0.5 s), failed requests,
scale events, and TTFT / ITL percentiles. --png plots replicas, arrivals and TTFT p95 over
the day for every policy. The machine's CPU flags are printed beside the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import httpx  # noqa: E402

from bench.scale import (  # noqa: E402
    TRACE,
    client,
    cpu_flags,
    load_trace,
    members,
    sim_model,
    spawn,
    stop,
    wait_members,
    wait_ready,
)
from rtp_serve.core.cost_model import StepCost  # noqa: E402
from rtp_serve.core.sim_cost import SimCost  # noqa: E402
from rtp_serve.services.launcher.servers import free_port, start_nats  # noqa: E402
from rtp_serve.services.planner import sizing  # noqa: E402

SAMPLE_S = 0.5


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    at_s: float
    ok: bool
    ttft_s: float = math.nan
    gaps: list[float] = field(default_factory=list)


def day_rate(t: float, args: argparse.Namespace) -> float:
    rate = args.peak_rate * (0.55 - 0.45 * math.cos(2 * math.pi * t / args.day_s))
    burst_at = args.burst_at * args.day_s
    if burst_at <= t < burst_at + args.burst_len * args.day_s:
        rate *= 5
    return rate


def arrivals(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    """Poisson arrivals at day_rate (thinning), carrying the trace's requests in order."""
    rng = random.Random(args.seed)
    top = args.peak_rate * 5
    times, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= args.day_s:
            break
        if rng.random() < day_rate(t, args) / top:
            times.append(t)
    trace = load_trace(Path(args.trace), len(times), 1.0, args.max_output, vocab, args.max_input)
    if len(trace) < len(times):
        raise ValueError(f"the trace has {len(trace)} requests, the day needs {len(times)}")
    return [Arrival(at, r.prompt, r.max_tokens) for at, r in zip(times, trace, strict=False)]


def static_count(args: argparse.Namespace, cost: SimCost, rate: float, day: list[Arrival]) -> int:
    """Fused workers the planner's arithmetic says meet the targets at `rate`."""
    step = StepCost(cost.fixed_s, cost.prefill_token_s, cost.decode_row_s, 2048)
    demand = sizing.Demand(
        rate,
        sum(len(a.prompt) for a in day) / len(day),
        sum(a.max_tokens for a in day) / len(day),
    )
    targets = sizing.Targets(args.ttft_p95_ms / 1e3, args.itl_p95_ms / 1e3)
    return max(1, sizing.size_fused(sizing.WorkerModel(step), demand, targets, 64).workers)


async def stream(http: httpx.AsyncClient, model: str, a: Arrival, start: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + a.at_s - time.monotonic()))
    sent = time.monotonic()
    out = Outcome(a.at_s, False)
    body = {"model": model, "prompt": a.prompt, "max_tokens": a.max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                return out
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                if json.loads(line[6:]).get("choices"):
                    if last is None:
                        out.ttft_s = now - sent
                    else:
                        out.gaps.append(now - last)
                    last = now
    except httpx.HTTPError:
        return out
    out.ok = last is not None
    return out


async def sample_workers(nameservice: str, start: float, into: list[tuple[float, int]]) -> None:
    while True:
        with contextlib.suppress(Exception):
            into.append((time.monotonic() - start, len(await members(nameservice))))
        await asyncio.sleep(SAMPLE_S)


def planner_events(address: str) -> int:
    with contextlib.suppress(Exception), httpx.Client(timeout=5) as http:
        text = http.get(f"http://{address}/metrics").text
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("rtp:planner_scale_events_total")))  # fmt: skip
    return -1


def run_policy(args, policy: str, model: Path, day: list[Arrival], counts: dict) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"planner-{policy}-"))
    log = tmp / "services.log"
    nats = start_nats(tmp)
    procs = []
    try:
        ns_port, fe_port, pl_port = free_port(), free_port(), free_port()
        ns = f"127.0.0.1:{ns_port}"
        common = ("--nats-url", nats.url, "--log-level", "WARNING")
        procs.append(spawn("nameservice", "--port", str(ns_port), "--ttl", "3", *common, log=log))
        procs.append(spawn("master", "--nameservice", ns, *common, log=log))
        worker_flags = (f"--model {model} --num-blocks {args.num_blocks} --no-remote-cache "
                        f"--max-num-batched-tokens 2048 --cost {args.cost_file}")  # fmt: skip
        if policy.startswith("static"):
            n = counts[policy]
            procs.append(spawn("sim-worker", "--role", "fused", "--count", str(n), "--nameservice",
                               ns, *worker_flags.split(), *common, log=log))  # fmt: skip
            asyncio.run(wait_members(ns, n, timeout=120))
        else:
            procs.append(spawn(
                "planner", "--nameservice", ns, "--port", str(pl_port), "--actuator", "local",
                "--engine", "sim", "--mode", "fused", "--worker-flags", worker_flags,
                "--predictor", policy, "--ttft-p95-ms", str(args.ttft_p95_ms),
                "--itl-p95-ms", str(args.itl_p95_ms), "--min-workers", "1",
                "--max-workers", str(args.max_workers), "--interval-s", str(args.interval_s),
                "--down-cooldown-s", str(args.down_cooldown_s), "--cost", args.cost_file,
                "--drain-timeout", "5", "--max-num-seqs", "64", *common, log=log,
            ))  # fmt: skip
            asyncio.run(wait_members(ns, 1, timeout=120))
        procs.append(spawn("frontend", "--port", str(fe_port), "--nameservice", ns, "--model",
                           str(model), "--log-level", "WARNING", "--max-concurrent", "100000",
                           "--max-streams-per-client", "0", log=log))  # fmt: skip
        asyncio.run(wait_ready(f"127.0.0.1:{fe_port}"))

        async def replay() -> tuple[list[Outcome], list[tuple[float, int]], float]:
            samples: list[tuple[float, int]] = []
            start = time.monotonic() + 1.0
            sampler = asyncio.create_task(sample_workers(ns, start, samples))
            cpu0 = os.times()
            async with client(f"127.0.0.1:{fe_port}") as http:
                outs = await asyncio.gather(*(stream(http, args.model_id, a, start) for a in day))
            sampler.cancel()
            return list(outs), samples, sum(os.times()[:2]) - sum(cpu0[:2])

        outs, samples, _ = asyncio.run(replay())
        events = planner_events(f"127.0.0.1:{pl_port}") if not policy.startswith("static") else 0
    finally:
        for proc in reversed(procs):
            stop(proc)
        nats.stop()
    return summarize(args, policy, outs, samples, events)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else math.nan


def summarize(args, policy: str, outs: list[Outcome], samples, events: int) -> dict:
    windows = math.ceil(args.day_s / args.window_s)
    met, series = 0, []
    for w in range(windows):
        lo, hi = w * args.window_s, (w + 1) * args.window_s
        inside = [o for o in outs if lo <= o.at_s < hi]
        ttft = _pct([o.ttft_s for o in inside if o.ok], 0.95)
        itl = _pct([g for o in inside if o.ok for g in o.gaps], 0.95)
        failed = any(not o.ok for o in inside)
        ok = not inside or (not failed and ttft <= args.ttft_p95_ms / 1e3
                            and (math.isnan(itl) or itl <= args.itl_p95_ms / 1e3))  # fmt: skip
        met += ok
        series.append({"t": lo, "ttft_p95": ttft, "rate": len(inside) / args.window_s})
    worker_s = sum(n * SAMPLE_S for _, n in samples)
    ttfts = [o.ttft_s for o in outs if o.ok]
    gaps = [g for o in outs if o.ok for g in o.gaps]
    return {
        "policy": policy, "requests": len(outs), "failed": sum(not o.ok for o in outs),
        "windows_met": met / windows, "worker_s": worker_s, "scale_events": events,
        "ttft_p50": _pct(ttfts, 0.5), "ttft_p95": _pct(ttfts, 0.95), "ttft_p99": _pct(ttfts, 0.99),
        "itl_p50": _pct(gaps, 0.5), "itl_p95": _pct(gaps, 0.95),
        "replicas": samples, "windows": series,
    }  # fmt: skip


def table(results: list[dict]) -> str:
    peak = next((r["worker_s"] for r in results if r["policy"] == "static-peak"), None)
    head = ("| policy | windows met | worker-s | vs static peak | failed / requests | scale events "
            "| TTFT p50 / p95 / p99 (s) | ITL p50 / p95 (ms) |")  # fmt: skip
    lines = [head, "|" + "---|" * 8]
    for r in results:
        ratio = f"{r['worker_s'] / peak:.2f}x" if peak else "-"
        lines.append(
            f"| {r['policy']} | {r['windows_met']:.0%} | {r['worker_s']:.0f} | {ratio} "
            f"| {r['failed']} / {r['requests']} | {r['scale_events']} "
            f"| {r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} / {r['ttft_p99']:.2f} "
            f"| {r['itl_p50'] * 1e3:.0f} / {r['itl_p95'] * 1e3:.0f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ts = [i * args.day_s / 400 for i in range(400)]
    axes[1].plot(ts, [day_rate(t, args) for t in ts], color="black", label="offered rate")
    for r in results:
        axes[0].step([t for t, _ in r["replicas"]], [n for _, n in r["replicas"]],
                     where="post", label=r["policy"])  # fmt: skip
        w = r["windows"]
        axes[1].plot(
            [x["t"] for x in w], [x["rate"] for x in w], ".", label=f"{r['policy']} arrivals"
        )
        axes[2].plot([x["t"] for x in w], [x["ttft_p95"] for x in w], marker="o", label=r["policy"])
    axes[2].axhline(args.ttft_p95_ms / 1e3, color="red", linestyle="--", label="TTFT p95 target")
    axes[0].set_ylabel("workers registered")
    axes[1].set_ylabel("requests / s")
    axes[2].set_ylabel(f"TTFT p95 per {args.window_s:.0f} s window (s)")
    axes[2].set_xlabel(f"seconds into the compressed day ({args.day_s:.0f} s)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"bench/planner.py: planner vs static provisioning ({cpu_flags()})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policies", default="holt,last,static-peak,static-mean")
    ap.add_argument("--day-s", type=float, default=240.0, help="the day, compressed (wall s)")
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument(
        "--peak-rate", type=float, default=2.0, help="requests/s at noon (x5 in the burst)"
    )
    ap.add_argument(
        "--burst-at", type=float, default=0.65, help="the burst's start, share of the day"
    )
    ap.add_argument("--burst-len", type=float, default=0.05, help="its length, share of the day")
    ap.add_argument("--ttft-p95-ms", type=float, default=3000.0)
    ap.add_argument("--itl-p95-ms", type=float, default=250.0)
    ap.add_argument("--max-workers", type=int, default=12)
    ap.add_argument("--interval-s", type=float, default=2.0)
    ap.add_argument("--down-cooldown-s", type=float, default=10.0)
    ap.add_argument("--max-input", type=int, default=2048)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--cost", default=None, help="a bench/fit_sim.py profile (default: built-in)")
    ap.add_argument("--model", default="smollm2-135m", help="model dir or preset (config only)")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from rtp_serve.core.model_config import ModelConfig
    from rtp_serve.models.make_model import resolve_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-planner-"))
    source = resolve_model(args.model)
    vocab = ModelConfig.from_dir(source).vocab_size
    day = arrivals(args, vocab)
    model = sim_model(source, tmp / "model", max(len(a.prompt) + a.max_tokens for a in day) + 1)
    args.model_id = model.name
    cost = SimCost.load(args.cost) if args.cost else SimCost()
    args.cost_file = str(tmp / "cost.json")
    cost.save(args.cost_file)
    mean_rate = len(day) / args.day_s
    counts = {
        "static-peak": static_count(args, cost, args.peak_rate * 5, day),
        "static-mean": static_count(args, cost, mean_rate, day),
    }
    print(f"# {cpu_flags()}; load average {os.getloadavg()[0]:.1f}")
    print(f"# day {args.day_s:.0f} s, {len(day)} requests ({mean_rate:.2f}/s mean, "
          f"{args.peak_rate:.2f}/s noon, x5 burst at {args.burst_at:.0%}); prompts "
          f"{sum(len(a.prompt) for a in day) / len(day):.0f} tokens mean, outputs "
          f"{sum(a.max_tokens for a in day) / len(day):.0f}; targets TTFT p95 "
          f"{args.ttft_p95_ms:.0f} ms, ITL p95 {args.itl_p95_ms:.0f} ms; cost {cost.source}; "
          f"static peak {counts['static-peak']} workers, mean {counts['static-mean']}")  # fmt: skip
    results = []
    for policy in args.policies.split(","):
        results.append(run_policy(args, policy, model, day, counts))
        print(f"# {policy} done: load average {os.getloadavg()[0]:.1f}", flush=True)
    print(table(results))
    if args.png:
        plot(results, args, args.png)
    if args.json:
        Path(args.json).write_text(json.dumps(results, default=str))
    return results


if __name__ == "__main__":
    main()
