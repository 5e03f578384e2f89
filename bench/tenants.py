"""Tenants sharing a cluster: first come, first served against the fair scheduler, in one run.

    python bench/tenants.py                                   # smollm2-135m, fused:1 and pd:1:1
    python bench/tenants.py --topologies fused:1 --phase-s 20 --json /tmp/tenants.json

For each topology and each worker scheduler (`--scheduling fcfs`, then `fair`), one launched
cluster with four tenants' keys (docs/features/tenants.md):

    a  weight 1, concurrency=--a-concurrency (its burst is refused past it: 429)
    b  weight 1, the light tenant whose latency is watched
    c  weight 2, d  weight 1 (the weights phase)

and these phases, the same arrivals under both schedulers (the capacity C, in requests a
second, is measured once per topology, closed loop at --max-num-seqs, in the first run):

    solo     b alone, Poisson at rate rb = --b-requests / --phase-s (its baseline), capped
             at --b-share of capacity
    10x      a at 10 r and b at r = --load * C / 11 (together --load of capacity)
    burst    a at --burst x C (far above capacity), b at rb
    weights  c and d, each closed loop at 2 x --max-num-seqs (both saturating)

b's rate in the solo and burst phases is set by a count, so that its TTFT p95 rests on
enough requests (at r, a 30 s phase gave b 2 to 5 of them). b's requests are short
(--b-output-len), and its rate is capped at --b-share of the worker's request time (in
requests of the other tenants' length), so b stays well below its half of the worker: the
light tenant.

Reported per phase and tenant: TTFT p50/p95 and ITL p95 (ms, client-side, streaming), output
tokens/s, 429s and other errors, and each phase's total tokens/s fair over FCFS; then the
issue's goals: b's TTFT p95 solo and in the burst, side by side, and their ratio; the burst's
total tokens/s fair over FCFS; c:d output tokens while both are backlogged (up to when the
first of them sends its last request), and errors other than 429s. A program, not a timed
test: on a shared, noisy machine the numbers move from run to run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from bench.serve import RequestResult, openai_stream, run_load  # noqa: E402
from bench.workload import arrival_times, random_requests  # noqa: E402

KEYS = {"a": "sk-bench-a", "b": "sk-bench-b", "c": "sk-bench-c", "d": "sk-bench-d"}
SCHEDULERS = ("fcfs", "fair")


def key_file(a_concurrency: int) -> str:
    return (
        f"{KEYS['a']} tenant=a concurrency={a_concurrency}\n"
        f"{KEYS['b']} tenant=b\n"
        f"{KEYS['c']} tenant=c weight=2\n"
        f"{KEYS['d']} tenant=d weight=1\n"
    )


def cpu_flags() -> str:
    from rtp_serve.kernels.isa import bench_flags

    return bench_flags()


# -- one tenant's load -----------------------------------------------------------------------
class Run:
    """A cluster's endpoint: one stream per tenant key."""

    def __init__(self, url: str, model: str, session: aiohttp.ClientSession, args) -> None:
        self.url, self.model, self.session, self.args = url, model, session, args
        self.seed = 0

    def stream(self, tenant: str):
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        return openai_stream(self.url, self.model, self.session, headers=headers)

    def requests(self, tenant: str, n: int):
        self.seed += 1
        a = self.args
        output_len = a.b_output_len if tenant == "b" else a.output_len
        return random_requests(n, a.input_len, output_len, a.vocab, 1000 + self.seed)

    async def poisson(self, tenant: str, rate: float, seconds: float, seed: int):
        n = max(1, round(rate * seconds))
        arrivals = arrival_times(n, rate, 1.0, seed)
        return await run_load(self.stream(tenant), self.requests(tenant, n), arrivals)

    async def closed(self, tenant: str, n: int, concurrency: int):
        reqs = self.requests(tenant, n)
        return await run_load(self.stream(tenant), reqs, [0.0] * n, concurrency)


def token_times(r: RequestResult) -> list[float]:
    """Seconds from the load's start at which each of a request's tokens arrived."""
    if r.ttft is None:
        return []
    times = [r.start + r.ttft]
    for gap in r.itl:
        times.append(times[-1] + gap)
    return times


def stats(results: Sequence[RequestResult], seconds: float) -> dict:
    ok = [r for r in results if r.ok]
    refused = sum("HTTP 429" in r.error for r in results if not r.ok)
    ttft = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    itl = [g * 1e3 for r in ok for g in r.itl]

    def pct(xs: list[float], p: float) -> float:
        return float(np.percentile(xs, p)) if xs else float("nan")

    return {
        "requests": len(results),
        "ok": len(ok),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p95_ms": pct(ttft, 95),
        "itl_p95_ms": pct(itl, 95),
        "tokens_per_s": sum(r.output_tokens for r in ok) / seconds,
        "429s": refused,
        "errors": len(results) - len(ok) - refused,
        "error_samples": sorted({r.error for r in results if r.error and "429" not in r.error})[:3],
    }


# -- the phases ------------------------------------------------------------------------------
async def capacity(run: Run, args) -> float:
    n = 3 * args.max_num_seqs
    results, wall = await run.closed("c", n, args.max_num_seqs)
    return sum(r.ok for r in results) / wall


async def phases(run: Run, args, cap: float) -> dict:
    rate, s = args.load * cap / 11, args.phase_s
    # b stays light: at most --b-share of the worker's request time (its requests are
    # shorter, so more of them fit in that share).
    b_rate = min(args.b_requests / s, args.b_share * cap * args.output_len / args.b_output_len)
    out: dict = {"b_rate_rps": b_rate}
    b, wall = await run.poisson("b", b_rate, s, seed=1)
    out["solo"] = {"b": stats(b, wall)}
    (a, wa), (b, wb) = await asyncio.gather(
        run.poisson("a", 10 * rate, s, seed=2), run.poisson("b", rate, s, seed=3)
    )
    out["10x"] = {"a": stats(a, wa), "b": stats(b, wb)}
    (a, wa), (b, wb) = await asyncio.gather(
        run.poisson("a", args.burst * cap, s, seed=4), run.poisson("b", b_rate, s, seed=5)
    )
    wall = max(wa, wb)
    out["burst"] = {"a": stats(a, wall), "b": stats(b, wall)}
    # Each sends its first k at once: n - k more keep it backlogged, and the tokens are
    # counted while both are (with n barely above k, as before, that was the first few
    # completions: the start's transient, not the share).
    k = 2 * args.max_num_seqs
    n = k + max(4, round(cap * s))
    (c, wc), (d, wd) = await asyncio.gather(run.closed("c", n, k), run.closed("d", n, k))
    out["weights"] = {"c": stats(c, wc), "d": stats(d, wd)}
    # Both are backlogged until the first of them has sent its last request (from then on
    # its queue drains): count each one's tokens up to then.
    both = min(max((r.start for r in res), default=0.0) for res in (c, d))
    served = [sum(t <= both for r in res for t in token_times(r)) for res in (c, d)]
    out["weights"]["c:d_tokens_while_both_backlogged"] = served[0] / max(1, served[1])
    return out


async def one_cluster(topology: str, scheduling: str, args, cap: float | None):
    from rtp_serve.services.launcher.process import launch

    kind, *counts = topology.split(":")
    flags = ["--fused", counts[0]] if kind == "fused" else ["--prefill", counts[0], "--decode", counts[1]]  # fmt: skip
    os.environ["RTP_SCHEDULING"] = scheduling  # the workers' --scheduling (they inherit it)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text(key_file(args.a_concurrency))
        flags += ["--api-key-file", str(keys), "--max-num-seqs", str(args.max_num_seqs),
                  "--kv-cache-mib", str(args.kv_cache_mib), *args.launcher_args.split()]  # fmt: skip
        with launch(args.model, Path(tmp), *flags) as cluster:
            timeout = aiohttp.ClientTimeout(total=None)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                auth = {"Authorization": f"Bearer {KEYS['b']}"}
                async with session.get(f"{cluster.url}/v1/models", headers=auth) as reply:
                    model = (await reply.json())["data"][0]["id"]
                run = Run(cluster.url, model, session, args)
                if cap is None:
                    cap = await capacity(run, args)
                else:
                    await capacity(run, args)  # the same warm-up as the first run
                started = time.monotonic()
                result = await phases(run, args, cap)
                result["seconds"] = time.monotonic() - started
                result["capacity_rps"] = cap
                return result, cap


# -- report ----------------------------------------------------------------------------------
PHASES = ("solo", "10x", "burst", "weights")


def tenants(phase: dict) -> dict[str, dict]:
    return {t: s for t, s in phase.items() if isinstance(s, dict)}


def total_tokens_per_s(res: dict, phase: str) -> float:
    return sum(s["tokens_per_s"] for s in tenants(res[phase]).values())


def table(topology: str, runs: dict[str, dict]) -> str:
    head = (f"{'sched':5} {'phase':8} {'tenant':6} {'ttft p50':>9} {'ttft p95':>9} "
            f"{'itl p95':>8} {'tok/s':>7} {'ok':>4} {'429s':>5} {'errors':>6}")  # fmt: skip
    first = next(iter(runs.values()))
    lines = [
        f"== {topology} (capacity {first['capacity_rps']:.2f} req/s; "
        f"b at {first['b_rate_rps']:.2f} req/s in solo and burst)",
        head,
    ]
    for sched, res in runs.items():
        for phase in PHASES:
            for tenant, s in tenants(res[phase]).items():
                lines.append(
                    f"{sched:5} {phase:8} {tenant:6} {s['ttft_p50_ms']:9.0f} "
                    f"{s['ttft_p95_ms']:9.0f} {s['itl_p95_ms']:8.0f} {s['tokens_per_s']:7.1f} "
                    f"{s['ok']:4d} {s['429s']:5d} {s['errors']:6d}"
                )
    if set(runs) == set(SCHEDULERS):
        ratios = "  ".join(
            f"{phase} {total_tokens_per_s(runs['fair'], phase):.1f}/"
            f"{total_tokens_per_s(runs['fcfs'], phase):.1f} = "
            f"{total_tokens_per_s(runs['fair'], phase) / total_tokens_per_s(runs['fcfs'], phase):.2f}"
            for phase in PHASES
        )
        lines.append(f"total tokens/s fair/fcfs: {ratios}")
    return "\n".join(lines)


def goals(runs: dict[str, dict]) -> dict:
    """The issue's numbers (floats: ratios, ms and counts)."""
    out = {}
    for sched, res in runs.items():
        solo, burst = res["solo"]["b"]["ttft_p95_ms"], res["burst"]["b"]["ttft_p95_ms"]
        out[f"{sched}: b ttft p95 solo (ms)"] = solo
        out[f"{sched}: b ttft p95 burst (ms)"] = burst
        out[f"{sched}: b ttft p95 burst / solo (goal fair <= 1.2)"] = burst / solo
        out[f"{sched}: b ttft p95 10x / solo"] = res["10x"]["b"]["ttft_p95_ms"] / solo
        weights = res["weights"]
        out[f"{sched}: c:d tokens/s (whole phase)"] = (
            weights["c"]["tokens_per_s"] / weights["d"]["tokens_per_s"]
        )
        out[f"{sched}: c:d tokens while both backlogged (goal fair 2 +- 10%)"] = weights[
            "c:d_tokens_while_both_backlogged"
        ]
        out[f"{sched}: errors other than 429"] = sum(
            s["errors"] for phase in PHASES for s in tenants(res[phase]).values()
        )
    if set(runs) == set(SCHEDULERS):
        out["burst total tokens/s fair / fcfs (goal >= 0.95)"] = total_tokens_per_s(
            runs["fair"], "burst"
        ) / total_tokens_per_s(runs["fcfs"], "burst")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--topologies", default="fused:1,pd:1:1")
    p.add_argument("--schedulers", default=",".join(SCHEDULERS), help="fcfs, fair or both")
    p.add_argument("--phase-s", type=float, default=30.0, help="seconds of arrivals per phase")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8, help="per worker: the slots to share")
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--load", type=float, default=0.8, help="the 10x phase's share of capacity")
    p.add_argument(
        "--b-requests", type=int, default=24, help="b's requests in the solo and burst phases"
    )
    p.add_argument("--b-output-len", type=int, default=8, help="b's output tokens a request")
    p.add_argument(
        "--b-share", type=float, default=0.1, help="b's rate's cap, in the worker's capacity"
    )
    p.add_argument("--burst", type=float, default=4.0, help="a's burst rate, times capacity")
    p.add_argument("--a-concurrency", type=int, default=32, help="a's limit of requests in flight")
    p.add_argument("--launcher-args", default="", help="more `rtp-serve up` flags")
    p.add_argument("--json", default=None, help="write every number here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    from rtp_serve.core.model_config import ModelConfig
    from rtp_serve.models.make_model import resolve_model

    args = parse_args(argv)
    args.model = str(resolve_model(args.model))
    args.vocab = ModelConfig.from_dir(args.model).vocab_size
    print(f"cpu flags: {cpu_flags()}; cores: {os.cpu_count()}; load average: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)  # fmt: skip
    report = {}
    for topology in args.topologies.split(","):
        runs: dict[str, dict] = {}
        cap = None
        for sched in args.schedulers.split(","):
            runs[sched], cap = asyncio.run(one_cluster(topology, sched, args, cap))
        print(table(topology, runs), flush=True)
        report[topology] = {"runs": runs, "goals": goals(runs)}
        for name, value in report[topology]["goals"].items():
            print(f"  {name}: {value:.2f}")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
