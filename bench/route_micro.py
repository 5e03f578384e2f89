"""The master's Route decision alone, at N workers: the policy's `decide` on a synthetic
cluster view, the vectorized path beside the scalar reference, in one run.

    python bench/route_micro.py --workers 100,1000 [--mode fused|pd] [--routes 2000]
        [--policy cache_aware] [--max-local-prefill-tokens 1024]

In this process, no NATS, no gRPC: a ClusterView of N members (services/master/cluster.py)
fed like the master's (membership events, LoadReports with fitted cost models, KV events
into its prefix index), on a simulated clock. Each route advances the clock by
1 / --route-rate seconds; between routes every worker's LoadReport arrives every 0.25 s
(as they publish; at N = 1,000 and 500 routes/s, 8 reports a route), with random queues
and batches; a routed prompt is then stored on its worker (its KV events). Prompts come
from `--prompts` distinct ones of 8 to 512 blocks, each first held by `--copies` workers,
and a share `--fresh` of requests is a prompt nobody holds.

Two views are built from the same seed and driven in lockstep, one routed by the policy
(services/master/policy.py) and one by the scalar reference it must agree with
(services/master/policy_reference.py); every plan is compared (workers, matched blocks,
reason) and disagreements counted. Per N and path: `decide` p50/p99 (µs), routes per
CPU-second (CPU time of the decides alone), and the cost of applying one LoadReport. CPU
flags and the load average are printed beside them: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

from rtp_serve.core.cost_model import TIER_HOST, TIER_REMOTE, TIER_TRANSFER  # noqa: E402
from rtp_serve.services.common.pb import events_pb2, master_pb2  # noqa: E402
from rtp_serve.services.common.pb import nameservice_pb2 as ns  # noqa: E402
from rtp_serve.services.master import cluster  # noqa: E402
from rtp_serve.services.master.cluster import ClusterView  # noqa: E402
from rtp_serve.services.master.policy import Policy, make_policy  # noqa: E402

REPORT_INTERVAL_S = 0.25  # services/worker/kv_events.py
BLOCK_SIZE = 16


def cpu_flags() -> str:
    from rtp_serve.kernels.isa import bench_flags

    return bench_flags()


def prompt_keys(prompt: int, n: int) -> list[bytes]:
    keys, parent = [], b"\0" * 16
    for i in range(n):
        parent = hashlib.blake2b(parent + i.to_bytes(4, "little") + prompt.to_bytes(8, "little"),
                                 digest_size=16).digest()  # fmt: skip
        keys.append(parent)
    return keys


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def members(n: int, mode: str) -> list[ns.Member]:
    """Fused workers, or PD (a quarter of them prefill), on hosts of 8 workers each."""
    out = []
    for i in range(n):
        role = (
            ns.ROLE_FUSED
            if mode == "fused"
            else (ns.ROLE_PREFILL if i % 4 == 0 else ns.ROLE_DECODE)
        )
        out.append(ns.Member(id=f"w{i:05d}", role=role, address=f"10.0.{i // 8}.1:{50051 + i % 8}"))
    return out


def report(rng: random.Random, worker_id: str, fitted: bool) -> events_pb2.LoadReport:
    """A busy worker's load now, with a fitted cost model of smollm2-135m's order on a core."""
    running = rng.randrange(0, 16)
    jitter = rng.uniform(0.8, 1.25)
    r = events_pb2.LoadReport(
        worker_id=worker_id,
        num_waiting=rng.randrange(0, 6),
        num_running=running,
        free_blocks=rng.randrange(0, 4096),
        total_blocks=4096,
        queued_tokens=rng.choice((0, 0, rng.randrange(0, 8192))),
        block_size=BLOCK_SIZE,
        max_num_waiting=8,
        kv_block_bytes=16 * 2 * 2 * 30 * 64 * 2,
        remote_tier=True,
    )
    if fitted:
        r.step_fixed_s, r.step_token_s, r.step_row_s = 4e-3 * jitter, 9e-5 * jitter, 6e-4
        r.step_token_budget = 2048
        r.fetch_costs.add(tier=TIER_HOST, fixed_s=2e-4, byte_s=1e-10 * jitter)
        r.fetch_costs.add(tier=TIER_REMOTE, fixed_s=1e-3, byte_s=8e-10 * jitter)
        r.fetch_costs.add(tier=TIER_TRANSFER, fixed_s=5e-4, byte_s=4e-10 * jitter)
    return r


class Run:
    """One view and the policy routing on it."""

    def __init__(self, policy: Policy, clock: Clock, ms: list[ns.Member]) -> None:
        self.policy, self.view = policy, ClusterView(clock)
        Ev = ns.MembershipEvent
        for m in ms:
            self.view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=m))
        self.decide_s: list[float] = []
        self.decide_cpu = 0.0
        self.report_s: list[float] = []

    def store(self, worker_id: str, keys: list[bytes]) -> None:
        self.view.apply_kv_events(events_pb2.KVEvents(worker_id=worker_id, stored=keys))
        # An index that applies batches at its next query (len flushes) does it here, not
        # in the next decide: ingest is timed by bench/index_size.py, routing here.
        len(self.view.index)
        len(self.view.index.host)

    def load(self, r: events_pb2.LoadReport) -> None:
        began = time.perf_counter()
        self.view.apply_load(r)
        self.report_s.append(time.perf_counter() - began)

    def route(self, request: master_pb2.RouteRequest) -> master_pb2.RoutePlan:
        cpu, began = time.process_time(), time.perf_counter()
        plan = self.policy.decide(self.view, request).plan
        self.decide_s.append(time.perf_counter() - began)
        self.decide_cpu += time.process_time() - cpu
        return plan


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def setup(n: int, args: argparse.Namespace, policies: dict[str, Policy]):
    """One view per policy, all of N members with the same KV and loads."""
    rng = random.Random(args.seed)
    clock = Clock()
    ms = members(n, args.mode)
    runs = {name: Run(policy, clock, ms) for name, policy in policies.items()}
    ids = [m.id for m in ms]
    holders = [m.id for m in ms if m.role != ns.ROLE_DECODE]
    lengths = [rng.randrange(8, 513) for _ in range(args.prompts)]
    prompts = [prompt_keys(p, lengths[p]) for p in range(args.prompts)]
    for keys in prompts:
        for w in rng.sample(holders, args.copies):
            for run in runs.values():
                run.store(w, keys)
    unfitted = set(rng.sample(ids, int(args.unfitted * n)))
    for w in ids:
        r = report(rng, w, w not in unfitted)
        for run in runs.values():
            run.load(r)
    return runs, rng, clock, ids, unfitted, prompts


def request(
    rng: random.Random, prompts: list[list[bytes]], i: int, args
) -> master_pb2.RouteRequest:
    if rng.random() < args.fresh:
        keys = prompt_keys(args.prompts + i, rng.randrange(8, 513))
    else:  # a known prompt, maybe with a new tail
        keys = prompts[rng.randrange(args.prompts)]
        keys = keys[: rng.randrange(1, len(keys) + 1)]
        keys += prompt_keys(10**9 + i, rng.randrange(0, 64))
    return master_pb2.RouteRequest(
        request_id=f"r{i}",
        block_hashes=keys,
        num_prompt_tokens=len(keys) * BLOCK_SIZE - rng.randrange(0, BLOCK_SIZE),
        session_id=f"s{rng.randrange(50)}" if rng.random() < 0.2 else "",
    )


def bench(n: int, args: argparse.Namespace) -> None:
    policies = {"vectorized": make_policy(args.policy, args.max_local_prefill_tokens)}
    if not args.no_reference:
        from rtp_serve.services.master.policy_reference import make_reference

        policies["reference"] = make_reference(args.policy, args.max_local_prefill_tokens)
    runs, rng, clock, ids, unfitted, prompts = setup(n, args, policies)
    per_route = n / REPORT_INTERVAL_S / args.route_rate
    due, turn, disagree = 0.0, 0, 0
    for i in range(args.routes):
        clock.now += 1.0 / args.route_rate
        due += per_route
        while due >= 1:
            due -= 1
            w = ids[turn % n]
            turn += 1
            r = report(rng, w, w not in unfitted)
            for run in runs.values():
                run.load(r)
        req = request(rng, prompts, i, args)
        plans = {name: run.route(req) for name, run in runs.items()}
        first = plans["vectorized"]
        if any(p != first for p in plans.values()):
            disagree += 1
        computer = first.prefill.id or first.decode.id
        for run in runs.values():
            run.store(computer, list(req.block_hashes))
    load = os.getloadavg()
    print(f"\nN = {n} ({args.mode}, {args.policy}, {args.routes} routes, "
          f"{per_route:.1f} reports a route), load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")  # fmt: skip
    print("| path | decide p50 / p99 (µs) | routes / CPU-second | LoadReport apply p50 (µs) |")
    print("|---|---|---|---|")
    for name, run in runs.items():
        rate = len(run.decide_s) / run.decide_cpu if run.decide_cpu else float("inf")
        print(
            f"| {name} | {pct(run.decide_s, 0.5) * 1e6:,.0f} / {pct(run.decide_s, 0.99) * 1e6:,.0f}"
            f" | {rate:,.0f} | {statistics.median(run.report_s) * 1e6:.1f} |"
        )
    if len(runs) > 1:
        print(f"plans that differ between the paths: {disagree} of {args.routes}")


async def ingest_and_route(
    run: Run, rng: random.Random, prompts, ids, args
) -> tuple[list[float], list[float]]:
    """Routes arriving every 1 / --route-rate s on the loop where KV events arrive in bursts
    of --burst messages every --burst-ms, handled the way the master's NATS subscription
    does (nats-py: queued messages back to back, each parsed, then ClusterView's handler);
    each route's latency from its arrival to its plan, and its `decide` alone (what the
    master's rtp:route_duration_seconds times)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    seqs = dict.fromkeys(ids, 0)

    async def subscription() -> None:
        while True:
            data = await queue.get()
            await run.view._on_kv_events(events_pb2.KVEvents.FromString(data), {})

    async def reader() -> None:
        fresh = 0
        while True:
            for _ in range(args.burst):
                w = rng.choice(ids)
                fresh += 1
                keys = prompt_keys(2 * 10**9 + fresh, 64)
                msg = events_pb2.KVEvents(worker_id=w, stored=keys)
                queue.put_nowait(msg.SerializeToString())
                seqs[w] += 1
            await asyncio.sleep(args.burst_ms / 1e3)

    tasks = [asyncio.create_task(subscription()), asyncio.create_task(reader())]
    latency: list[float] = []
    decide: list[float] = []
    done = asyncio.Event()

    async def handle(arrival: float, req: master_pb2.RouteRequest) -> None:
        # As grpc.aio runs a call: a task of its own, started when the call arrives.
        began = time.perf_counter()
        run.policy.decide(run.view, req)
        decide.append(time.perf_counter() - began)
        latency.append(loop.time() - arrival)
        if len(latency) == args.routes:
            done.set()

    start = loop.time() + 0.05
    for i in range(args.routes):
        arrival = start + i / args.route_rate
        req = request(rng, prompts, i, args)
        loop.call_at(arrival, lambda a=arrival, r=req: tasks.append(loop.create_task(handle(a, r))))
    await done.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return latency, decide


def ingest(n: int, args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(f"\nN = {n}: routes at {args.route_rate:g}/s beside KV-event bursts of {args.burst} "
          f"messages (64 blocks each) every {args.burst_ms:g} ms; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")  # fmt: skip
    print("| ingest | route latency from arrival p50 / p99 / max (ms) | decide alone p50 / p99 "
          "(ms) | blocks ingested |")  # fmt: skip
    print("|---|---|---|---|")
    for name, slice_s in (("back to back", math.inf), ("yields every 2 ms", 0.002)):
        cluster.INGEST_SLICE_S = slice_s
        policy = make_policy(args.policy, args.max_local_prefill_tokens)
        runs, rng, _, ids, _, prompts = setup(n, args, {name: policy})
        run = runs[name]
        before = len(run.view.index)
        latency, decide = asyncio.run(ingest_and_route(run, rng, prompts, ids, args))
        print(
            f"| {name} | {pct(latency, 0.5) * 1e3:.2f} / {pct(latency, 0.99) * 1e3:.2f} / "
            f"{max(latency) * 1e3:.2f} | {pct(decide, 0.5) * 1e3:.2f} / "
            f"{pct(decide, 0.99) * 1e3:.2f} | {len(run.view.index) - before:,} |"
        )
    cluster.INGEST_SLICE_S = 0.002


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", default="100,1000", help="comma-separated N")
    p.add_argument("--mode", choices=("fused", "pd"), default="fused")
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--max-local-prefill-tokens", type=int, default=1024)
    p.add_argument("--routes", type=int, default=2000)
    p.add_argument("--route-rate", type=float, default=500.0, help="routes per simulated second")
    p.add_argument("--prompts", type=int, default=300)
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--fresh", type=float, default=0.3)
    p.add_argument("--unfitted", type=float, default=0.0, help="share of workers not fitted yet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-reference", action="store_true", help="time the vectorized path only")
    p.add_argument("--ingest", action="store_true",
                   help="instead: route latency on the event loop beside bursts of KV events, "
                   "the master's ingest yielding to the loop or not")  # fmt: skip
    p.add_argument("--burst", type=int, default=100, help="--ingest: messages a burst")
    p.add_argument("--burst-ms", type=float, default=100.0, help="--ingest: between bursts")
    args = p.parse_args()
    print(f"CPU flags: {cpu_flags()}; {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    for n in (int(x) for x in args.workers.split(",")):
        (ingest if args.ingest else bench)(n, args)


if __name__ == "__main__":
    main()
