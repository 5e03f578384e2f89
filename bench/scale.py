"""The control plane at scale: real NATS, nameservice, master and frontend in front of N
simulated workers (`rtp-serve sim-worker`), the Mooncake trace at its real token lengths.

    python bench/scale.py --workers 10,100,1000 [--requests 1000] [--time-scale 0.05]
        [--cost sim_cost.json] [--cost-scale 1] [--mode fused|pd] [--max-output 8] [--procs 4]
        [--masters 2] [--policies round_robin,least_load,cache_aware] [--replay-only]

Per N, one table:
  - master route latency p50/p99, server side (rtp:route_duration_seconds, interpolated
    within its histogram buckets), and routes per master CPU-second;
  - master RSS, the prefix index's blocks, and RSS growth per indexed block;
  - KV-event ingest at the master (blocks/s over the replay) and its lag behind the
    workers' publishing (rtp:index_event_lag_seconds, p50/p99);
  - nameservice CPU (% of one core) under N heartbeats, idle cluster;
  - time from a worker's SIGKILL to the last request the master routed to it;
  - the frontend's completed requests per CPU-second;
  - the replay: requests, failures, TTFT p50/p95, prefix reuse (also as a share of what one
    infinite cache shared by every worker would reuse), the master's TTFT prediction error
    (the frontend's rtp:ttft_prediction_*error_seconds), the load average;
  - with --masters 2 (active-active replicas, the frontend spreading its routes over both):
    their agreement (--probes RouteRequests of trace prompts, each sent to both masters at
    once during the replay, then released at both) and the frontend's move to the survivor
    when one is SIGKILLed under load.
With several --policies each N runs once per policy, and a last table compares them
(against round_robin). --replay-only skips everything but the replay (and the agreement).
CPU flags are printed beside the numbers. The machine is shared: every number is noisy.

Every 512-token block of the trace is built from its hash id (equal ids, equal tokens), so
prompts have the trace's real lengths; outputs are cut at --max-output; arrivals are
multiplied by --time-scale. The simulated workers serve a copy of the model's config and
tokenizer with a context long enough for the trace (no weights: they load none).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import grpc  # noqa: E402
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rtp_serve.core.block_hash import block_hash_keys, salt_of  # noqa: E402
from rtp_serve.core.model_config import ModelConfig  # noqa: E402
from rtp_serve.core.sampling_params import SamplingParams  # noqa: E402
from rtp_serve.core.sim_cost import SimCost  # noqa: E402
from rtp_serve.services.common import grpc_util, rendezvous  # noqa: E402
from rtp_serve.services.common.convert import params_to_pb  # noqa: E402
from rtp_serve.services.common.kv_namespace import KVNamespace  # noqa: E402
from rtp_serve.services.common.pb import (  # noqa: E402
    master_pb2,
    master_pb2_grpc,
    nameservice_pb2,
    nameservice_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from rtp_serve.services.frontend.route_batcher import RouteBatcher  # noqa: E402
from rtp_serve.services.launcher.servers import free_port, start_nats  # noqa: E402

TRACE = _ROOT.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"
TRACE_BLOCK = 512  # tokens per hash id in the trace


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at_s: float
    prompt: list[int]
    max_tokens: int


def load_trace(
    path: Path,
    n: int,
    time_scale: float,
    max_output: int,
    vocab: int,
    max_input: int = 0,
    skip: int = 0,
) -> list[TraceRequest]:
    """`n` requests of the trace after its first `skip`, arrivals from the first's."""
    out = []
    t0 = None
    with path.open() as f:
        for i, line in enumerate(f):
            if len(out) >= n:
                break
            if i < skip:
                continue
            row = json.loads(line)
            t0 = row["timestamp"] if t0 is None else t0
            prompt: list[int] = []
            for h in row["hash_ids"]:
                prompt += [(h * 7919 + j * 31 + 1) % vocab for j in range(TRACE_BLOCK)]
            prompt = prompt[: min(row["input_length"], max_input or row["input_length"])]
            tokens = max(1, min(row["output_length"], max_output))
            out.append(TraceRequest((row["timestamp"] - t0) / 1000 * time_scale, prompt, tokens))
    return out


def ceiling_tokens(prompts: list[list[int]], block_size: int) -> int:
    """Prompt tokens one infinite prefix cache shared by every worker would serve: each
    prompt's leading full blocks that an earlier prompt also had (chained keys: a block
    counts only after every block before it), less the last token, which is always computed
    (bench/route.py's rule, over block keys instead of token tuples: real lengths)."""
    seen: set[bytes] = set()
    reused = 0
    for prompt in prompts:
        usable = (len(prompt) - 1) // block_size
        keys = block_hash_keys(prompt, block_size)
        hits = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
        reused += min(hits, usable) * block_size
        seen.update(keys)
    return reused


def sim_model(model: Path, into: Path, context: int) -> Path:
    """The model's config (context raised to `context`) and tokenizer, without weights."""
    into.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, into / f.name)
    config = json.loads((into / "config.json").read_text())
    config["max_position_embeddings"] = max(config.get("max_position_embeddings", 0), context)
    (into / "config.json").write_text(json.dumps(config))
    return into


# -- processes --------------------------------------------------------------------------
def spawn(name: str, *flags: str, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "rtp_serve.services.cli", name, *flags]
    out = log.open("ab")
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` (its own affinity is its main thread's only) to `cpus`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), cpus)


def pin_master(args, masters: list[int], others: list[int]) -> None:
    """--master-cpu: the master replicas on that CPU alone, every other process of the
    bench (this one, NATS, the services, the simulated workers) on the rest: the master on
    a core of its own, as a deployment gives it, so its route latency is its own."""
    if args.master_cpu is None:
        return
    rest = os.sched_getaffinity(0) - {args.master_cpu}
    if not rest:
        raise SystemExit(f"--master-cpu {args.master_cpu}: no CPU left for the rest")
    for pid in masters:
        pin(pid, {args.master_cpu})
    for pid in [os.getpid(), *others]:
        pin(pid, rest)


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_flags() -> str:
    from rtp_serve.kernels.isa import bench_flags

    return bench_flags()


# -- metrics ----------------------------------------------------------------------------
def scrape(address: str) -> dict[str, list]:
    reply = httpx.get(f"http://{address}/metrics", timeout=30)
    reply.raise_for_status()
    text = reply.text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def total(metrics: dict[str, list], family: str, suffix: str = "") -> float:
    return sum(s.value for s in metrics.get(family, []) if s.name == family + suffix)


def merged(scrapes: list[dict[str, list]]) -> dict[str, list]:
    """Several processes' scrapes as one: samples of the same name and labels summed (for
    counters and histograms; a gauge comes out as the sum too)."""
    from prometheus_client.samples import Sample

    out: dict[str, dict[tuple, float]] = {}
    for metrics in scrapes:
        for family, samples in metrics.items():
            acc = out.setdefault(family, {})
            for x in samples:
                key = (x.name, tuple(sorted(x.labels.items())))
                acc[key] = acc.get(key, 0.0) + x.value
    return {
        family: [Sample(name, dict(labels), v) for (name, labels), v in acc.items()]
        for family, acc in out.items()
    }


def minus(after: dict[str, list], before: dict[str, list]) -> dict[str, list]:
    """One process's counters and histograms over a window: `after` less `before`."""
    from prometheus_client.samples import Sample

    negated = {f: [Sample(x.name, x.labels, -x.value) for x in xs] for f, xs in before.items()}
    return merged([after, negated])


def routes_by(frontend: dict[str, list], source: str) -> float:
    """Worker streams the frontend routed, by who chose: "master" or "fallback"."""
    samples = frontend.get("rtp:routes", [])
    return sum(
        x.value for x in samples if x.name == "rtp:routes_total" and x.labels["source"] == source
    )


def gc_pauses(metrics: dict[str, list]) -> dict | None:
    """rtp:gc_pause_seconds over a window (every generation): collections, their seconds
    in all, full collections, and the bound of the bucket that holds the longest."""
    family = "rtp:gc_pause_seconds"
    samples = metrics.get(family, [])
    count = sum(s.value for s in samples if s.name == family + "_count")
    if not count:
        return None
    by_le: dict[float, float] = {}
    for s in samples:
        if s.name == family + "_bucket":
            by_le[float(s.labels["le"])] = by_le.get(float(s.labels["le"]), 0.0) + s.value
    longest = min(le for le, n in by_le.items() if n >= count)
    full = sum(
        s.value
        for s in samples
        if s.name == family + "_count" and s.labels.get("generation") == "2"
    )
    return {"count": count, "seconds": total(metrics, family, "_sum"), "full": full,
            "longest_le_s": longest}  # fmt: skip


def histogram_quantile(metrics: dict[str, list], family: str, q: float) -> float | None:
    """The q-quantile of a histogram, interpolated linearly within its bucket."""
    buckets = sorted(
        (float(s.labels["le"]), s.value)
        for s in metrics.get(family, [])
        if s.name == family + "_bucket"
    )
    if not buckets or buckets[-1][1] == 0:
        return None
    # (a histogram of signed values has negative buckets: the lowest starts at its bound)
    rank, prev_le, prev_n = q * buckets[-1][1], min(0.0, buckets[0][0]), 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 0)
        prev_le, prev_n = le, n
    return prev_le


# -- the cluster ------------------------------------------------------------------------
@dataclass
class ScaleCluster:
    nats_url: str
    nameservice: str
    masters: list[str]  # active-active replicas; procs "master", "master-1", ...
    master_metrics: list[str]
    frontend: str
    procs: dict[str, subprocess.Popen]
    workers: list[subprocess.Popen]
    warm: dict | None = None  # --warm-blocks: the warm index's ingest (`wait_warm`)

    @property
    def master(self) -> str:
        return self.masters[0]


def master_proc(i: int) -> str:
    return "master" if i == 0 else f"master-{i}"


@contextlib.contextmanager
def cluster(args, n: int, model: Path, tmp: Path, policy: str) -> Iterator[ScaleCluster]:
    log = Path(args.log_dir or tmp) / f"services-{n}-{policy}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    nats = start_nats(tmp)
    procs: dict[str, subprocess.Popen] = {}
    workers: list[subprocess.Popen] = []
    ours = os.sched_getaffinity(0)  # --master-cpu narrows this process's too, until the end
    try:
        ns_port, fe_port = free_port(), free_port()
        ns = f"127.0.0.1:{ns_port}"
        common = ("--nats-url", nats.url, "--log-level", "WARNING")
        procs["nameservice"] = spawn(
            "nameservice", "--port", str(ns_port), "--ttl", str(args.ttl), *common, log=log
        )
        masters, master_metrics = [], []
        for i in range(args.masters):
            m_port, m_metrics = free_port(), free_port()
            masters.append(f"127.0.0.1:{m_port}")
            master_metrics.append(f"127.0.0.1:{m_metrics}")
            procs[master_proc(i)] = spawn(
                "master", "--port", str(m_port), "--nameservice", ns, "--metrics-port",
                str(m_metrics), "--policy", policy, "--event-cutoff-ms", str(args.event_cutoff_ms),
                *common, log=log,
            )  # fmt: skip
        rss0 = asyncio.run(wait_metrics(master_metrics[0], procs["master"].pid))
        spawned = time.monotonic()
        roles = (
            [("fused", n)]
            if args.mode == "fused"
            else [("prefill", n // 2), ("decode", n - n // 2)]
        )
        for role, count in roles:
            per = -(-count // args.procs)
            for start in range(0, count, per):
                workers.append(
                    spawn(
                        "sim-worker", "--role", role, "--count", str(min(per, count - start)),
                        "--model", str(model), "--nameservice", ns, "--num-blocks",
                        str(args.num_blocks), "--block-size", str(args.block_size),
                        "--max-num-batched-tokens", "2048", "--no-remote-cache",
                        "--warm-blocks", str(args.warm_blocks),
                        *(("--cost", args.cost) if args.cost else ()), *common, log=log,
                    )
                )  # fmt: skip
        asyncio.run(wait_members(ns, n, timeout=60 + n * 0.2))
        warm = None
        if args.warm_blocks:
            warm = asyncio.run(wait_warm(master_metrics, n * args.warm_blocks, spawned))
            warm["rss_per_block"] = (rss_bytes(procs["master"].pid) - rss0) / warm["blocks"]
        procs["frontend"] = spawn(
            "frontend", "--port", str(fe_port), "--nameservice", ns, "--master",
            ",".join(masters), "--model", str(model), "--log-level", "WARNING",
            "--max-concurrent", "100000", "--max-streams-per-client", "0", log=log,
        )  # fmt: skip
        asyncio.run(wait_ready(f"127.0.0.1:{fe_port}"))
        ms = {procs[master_proc(i)].pid for i in range(args.masters)}
        rest = [p.pid for p in [*procs.values(), *workers] if p.pid not in ms] + [nats.pid]
        pin_master(args, sorted(ms), rest)
        yield ScaleCluster(
            nats.url, ns, masters, master_metrics, f"127.0.0.1:{fe_port}", procs, workers, warm
        )  # fmt: skip
    finally:
        for proc in [*workers, *reversed(procs.values())]:
            stop(proc)
        nats.stop()
        pin(os.getpid(), ours)


async def members(nameservice: str) -> list[nameservice_pb2.Member]:
    async with grpc_util.channel(nameservice) as ch:
        reply = await nameservice_pb2_grpc.NameServiceStub(ch).List(
            nameservice_pb2.ListRequest(), timeout=10
        )
    workers = (
        nameservice_pb2.ROLE_FUSED,
        nameservice_pb2.ROLE_PREFILL,
        nameservice_pb2.ROLE_DECODE,
    )
    return [m for m in reply.members if m.role in workers]


async def wait_members(nameservice: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):
            if len(await members(nameservice)) >= n:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} workers not registered within {timeout:.0f} s")
        await asyncio.sleep(0.5)


async def wait_metrics(address: str, pid: int, timeout: float = 60.0) -> int:
    """Wait for a service's metrics endpoint; its RSS then (bytes)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=f"http://{address}", timeout=5) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if (await http.get("/metrics")).status_code == 200:
                    return rss_bytes(pid)
            await asyncio.sleep(0.2)
    raise TimeoutError(f"no metrics at {address}")


def index_blocks(metrics_address: str) -> float:
    """(worker, block) pairs in a master's index, from its metrics (the Index RPC would
    carry every hash: hundreds of MB at 10M blocks)."""
    return total(scrape(metrics_address), "rtp:index_blocks")


async def wait_warm(master_metrics: list[str], blocks: int, since: float) -> dict:
    """--warm-blocks: wait until every master's index holds the workers' warm blocks (all
    but 0.1%: a few may share a key) and has settled (its block count and resyncs the same
    a second later: a burst this large can cost a master its NATS connection as a slow
    consumer, and it then resyncs every worker); their ingest from the workers' first
    start."""
    deadline = time.monotonic() + 900
    last = None
    while True:
        seen = [await asyncio.to_thread(scrape, a) for a in master_metrics]
        held = [total(m, "rtp:index_blocks") for m in seen]
        now = [
            (h, total(m, "rtp:index_resyncs", "_total")) for h, m in zip(held, seen, strict=True)
        ]
        if min(held) >= 0.999 * blocks and now == last:
            took = time.monotonic() - since
            return {"blocks": min(held), "seconds": took, "rate": min(held) / took,
                    "resyncs": sum(r for _, r in now)}  # fmt: skip
        if time.monotonic() > deadline:
            raise TimeoutError(f"masters hold {held} of {blocks} warm blocks after 900 s")
        last = now
        await asyncio.sleep(1.0)


async def wait_ready(frontend: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=f"http://{frontend}", timeout=5) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if (await http.get("/ready")).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise TimeoutError("the frontend never became ready")


# -- the replay -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Result:
    ok: bool
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


async def stream(
    http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, request_id: str = ""
) -> Result:
    """One streamed completion through the frontend: its time to first token and usage."""
    sent = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"X-Request-Id": request_id} if request_id else None
    ttft, usage = None, {}
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
            if reply.status_code != 200:
                return Result(False, 0.0, len(prompt), 0)
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("choices"):
                    ttft = time.monotonic() - sent
                usage = chunk.get("usage") or usage
    except httpx.HTTPError:
        return Result(False, 0.0, len(prompt), 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Result(ttft is not None, ttft or 0.0, len(prompt), cached or 0)


def client(frontend: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    return httpx.AsyncClient(base_url=f"http://{frontend}", timeout=600, limits=limits)


async def replay(
    frontend: str, model: str, trace: list[TraceRequest], start: float
) -> list[Result]:
    """`trace` through the frontend, each request at `start` + its arrival."""
    async with client(frontend) as http:

        async def one(req: TraceRequest) -> Result:
            await asyncio.sleep(max(0.0, start + req.at_s - time.monotonic()))
            return await stream(http, model, req.prompt, req.max_tokens)

        return await asyncio.gather(*(one(r) for r in trace))


# -- two masters: agreement and failover -------------------------------------------------
async def agreement(
    masters: list[str], probes: list[tuple[float, master_pb2.RouteRequest]], start: float
) -> dict:
    """Each probe (a trace prompt's RouteRequest, at its request's arrival) sent to every
    master at once, then released at each: the share of probes they all routed to the same
    worker (and prefill worker), and of the disagreements those where the masters matched
    as many of the prompt's blocks (so their load views differed, not their indexes)."""
    channels = [grpc_util.channel(a) for a in masters]
    stubs = [master_pb2_grpc.MasterStub(ch) for ch in channels]
    outcomes: list[str] = []

    async def one(at_s: float, request: master_pb2.RouteRequest) -> None:
        await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
        request.unix_ms = time.time_ns() // 1_000_000  # as the frontend stamps it
        calls = [stub.Route(request, timeout=10) for stub in stubs]
        plans = await asyncio.gather(*calls, return_exceptions=True)
        release = master_pb2.ReleaseRequest(
            request_id=request.request_id, frontend_id=request.frontend_id
        )
        await asyncio.gather(
            *(stub.Release(release, timeout=10) for stub in stubs), return_exceptions=True
        )
        if any(isinstance(p, BaseException) for p in plans):
            outcomes.append("failed")
        elif len({(p.decode.id, p.prefill.id) for p in plans}) == 1:
            outcomes.append("agree")
        elif len({p.matched_blocks for p in plans}) == 1:
            outcomes.append("load")
        else:
            outcomes.append("index")

    try:
        await asyncio.gather(*(one(at, r) for at, r in probes))
    finally:
        for ch in channels:
            await ch.close()
    answered = [o for o in outcomes if o != "failed"]
    differ = [o for o in answered if o != "agree"]
    return {
        "probes": len(outcomes),
        "probe_failed": len(outcomes) - len(answered),
        "agreement": answered.count("agree") / len(answered) if answered else None,
        "disagree_same_match": differ.count("load") / len(differ) if differ else None,
    }


def probe_requests(
    trace: list[TraceRequest], n: int, kv: KVNamespace
) -> list[tuple[float, master_pb2.RouteRequest]]:
    """`n` of the trace's requests, evenly spaced, as the frontend would ask for them."""
    step = max(1, len(trace) // max(1, n))
    return [
        (
            req.at_s,
            master_pb2.RouteRequest(
                request_id=f"probe-{i}",
                frontend_id="scale-probe",
                packed_block_hashes=b"".join(kv.keys(req.prompt)),  # as the frontend sends
                num_prompt_tokens=len(req.prompt),
            ),
        )  # fmt: skip
        for i, req in enumerate(trace[::step][:n])
    ]


async def failover(c: ScaleCluster, model: str, vocab: int, rate: float, window_s: float) -> dict:
    """Short streams through the frontend at `rate`/s for `window_s` seconds; a third of the
    way in, the last master is SIGKILLed. Of the requests sent after the kill: failures,
    how many the frontend routed by itself, and the time to first token of those whose id
    hashes to the dead master first (each pays the failed call before asking the other)
    against the rest's."""
    dead = c.masters[-1]
    proc = c.procs[master_proc(len(c.masters) - 1)]
    fallback0 = routes_by(scrape(c.frontend), "fallback")
    sent: list[tuple[float, str, asyncio.Task[Result]]] = []
    killed = None
    async with client(c.frontend) as http:
        start = time.monotonic()
        for i in range(int(rate * window_s)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            if killed is None and i >= rate * window_s / 3:
                proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
            rid = f"failover-{os.getpid()}-{i}"
            prompt = [(i * 131 + j) % vocab for j in range(64)]
            task = asyncio.create_task(stream(http, model, prompt, 2, rid))
            sent.append((time.monotonic(), rid, task))
        await asyncio.gather(*(t for _, _, t in sent))
    proc.wait()
    fallback = routes_by(scrape(c.frontend), "fallback") - fallback0
    after = [(rid, t.result()) for at, rid, t in sent if killed is not None and at >= killed]
    to_dead = [r.ttft_s for rid, r in after if r.ok and rendezvous.order(rid, c.masters)[0] == dead]
    others = [r.ttft_s for rid, r in after if r.ok and rendezvous.order(rid, c.masters)[0] != dead]
    return {
        "failover_requests": len(after),
        "failover_failed": sum(not r.ok for _, r in after),
        "failover_fallback_routes": fallback,
        "failover_ttft_dead_first_p50_s": _pct(sorted(to_dead), 50),
        "failover_ttft_dead_first_max_s": max(to_dead) if to_dead else None,
        "failover_ttft_others_p50_s": _pct(sorted(others), 50),
    }


# -- the master's capacity ---------------------------------------------------------------
async def route_capacity(
    c: ScaleCluster,
    requests: list[master_pb2.RouteRequest],
    window_s: float,
    concurrency: int,
    batched: bool,
) -> dict:
    """Routes back to back at the first master (`concurrency` in flight; the replay's
    prompts, fresh ids, no lease) for `window_s`, after as long a window with none: routes
    answered per second, per master CPU-second, and per CPU-second less the idle window's
    (what the N workers' load reports and heartbeats cost it anyway). `batched`: through the
    frontend's RouteBatcher (the routes that come while a call is in flight go as one
    RouteBatch), else one Route call each. Keys are prefixed `capacity_` or
    `capacity_batched_`, and the latter's mean batch size is given."""
    pid = c.procs["master"].pid
    cpu0, t0 = cpu_s(pid), time.monotonic()
    await asyncio.sleep(window_s)
    idle_cpu_per_s = (cpu_s(pid) - cpu0) / (time.monotonic() - t0)
    answered = 0
    async with grpc_util.channel(c.master) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        batcher = RouteBatcher(lambda: stub)
        calls0 = batcher.calls
        cpu0, t0 = cpu_s(pid), time.monotonic()
        end = t0 + window_s

        async def caller(k: int) -> None:
            nonlocal answered
            i = k
            while time.monotonic() < end:
                request = master_pb2.RouteRequest()
                request.CopyFrom(requests[i % len(requests)])
                request.request_id = f"capacity-{i}"
                if batched:
                    await batcher.route(request, 10.0)
                else:
                    await stub.Route(request, timeout=10)
                answered += 1
                i += concurrency

        await asyncio.gather(*(caller(k) for k in range(concurrency)))
        wall, cpu = time.monotonic() - t0, cpu_s(pid) - cpu0
    routing_cpu = cpu - idle_cpu_per_s * wall
    key = "capacity_batched_" if batched else "capacity_"
    out = {
        key + "routes_per_s": answered / wall,
        key + "routes_per_cpu_s": answered / cpu if cpu else None,
        key + "routes_per_routing_cpu_s": answered / routing_cpu if routing_cpu > 0 else None,
        key + "idle_cpu": idle_cpu_per_s,
    }
    if batched:
        out[key + "mean_batch"] = answered / max(1, batcher.calls - calls0)
    return out


# -- a restarted master -----------------------------------------------------------------
async def master_restart_s(
    c: ScaleCluster, log: Path, settle_s: float, master_cpu: int | None, timeout: float = 300.0
) -> float | None:
    """SIGKILL the master and start it again on its port: seconds until it has rebuilt
    every member's part of its index (a startup resync each, from its snapshot) and holds
    the pairs the old one held (the idle workers hold what they held; 0.1% slack, for an old
    index a batch behind). `settle_s` first, so that the old master has counted the last
    events (under an event cutoff, those of the last two cutoffs wait)."""
    await asyncio.sleep(settle_s)
    held = await asyncio.to_thread(index_blocks, c.master_metrics[0])
    members_now = len(await members(c.nameservice))
    old = c.procs["master"]
    old.kill()
    old.wait()
    started = time.monotonic()
    out = log.open("ab")
    c.procs["master"] = subprocess.Popen(old.args, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    if master_cpu is not None:  # (its threads, started later, inherit it)
        pin(c.procs["master"].pid, {master_cpu})
    while time.monotonic() - started < timeout:
        with contextlib.suppress(httpx.TransportError, httpx.HTTPStatusError):
            metrics = await asyncio.to_thread(scrape, c.master_metrics[0])
            resynced = total(metrics, "rtp:index_resyncs", "_total")
            if resynced >= members_now and total(metrics, "rtp:index_blocks") >= 0.999 * held:
                return time.monotonic() - started
        await asyncio.sleep(0.1)
    return None


# -- a dead worker ----------------------------------------------------------------------
async def dead_worker_out_s(c: ScaleCluster, args, model: Path, tmp: Path) -> float:
    """Start one more worker, give it a prefix, SIGKILL it, and ask the master (as the
    frontend does) for that prefix until it no longer picks the dead worker: seconds from
    the kill to the last plan naming it."""
    victim_id = f"victim-{os.getpid()}"
    proc = spawn(
        "sim-worker", "--role", args.mode if args.mode == "fused" else "prefill", "--model",
        str(model), "--nameservice", c.nameservice, "--worker-id", victim_id, "--block-size",
        str(args.block_size), "--no-remote-cache", "--log-level", "WARNING",
        "--nats-url", c.nats_url, log=tmp / "victim.log",
    )  # fmt: skip
    try:
        victim = None
        for _ in range(240):
            victim = next((m for m in await members(c.nameservice) if m.id == victim_id), None)
            if victim is not None:
                break
            await asyncio.sleep(0.25)
        if victim is None:
            raise TimeoutError("the victim worker never registered")
        # Routing on a prompt only the victim holds: cache-aware routing prefers it.
        vocab = ModelConfig.from_dir(model).vocab_size
        prompt = [(os.getpid() * 31 + i) % vocab for i in range(args.block_size * 8)]
        salt = salt_of(victim.model_id, victim.kv_numerics)
        hashes = block_hash_keys(prompt, args.block_size, salt)
        async with grpc_util.channel(victim.address) as ch:
            request = worker_pb2.GenerateRequest(
                request_id="victim-warm", prompt_token_ids=prompt,
                params=params_to_pb(SamplingParams(max_tokens=1)), block_hashes=hashes,
            )  # fmt: skip
            async for _ in worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=30):
                pass
        await asyncio.sleep(1.0)  # its KV events reach the master
        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        last = killed
        async with grpc_util.channel(c.master) as ch:
            stub = master_pb2_grpc.MasterStub(ch)
            ttl = args.ttl
            while time.monotonic() - last < 2 * ttl and time.monotonic() - killed < 10 * ttl:
                plan = await stub.Route(
                    master_pb2.RouteRequest(block_hashes=hashes, num_prompt_tokens=len(prompt)),
                    timeout=5,
                )
                if victim_id in (plan.decode.id, plan.prefill.id):
                    last = time.monotonic()
                await asyncio.sleep(0.01)
        return last - killed
    finally:
        stop(proc)


# -- one N ------------------------------------------------------------------------------
STEPS = ("idle", "capacity", "failover", "restart", "dead-worker")  # what --skip may leave out


def run(args, n: int, model: Path, trace: list[TraceRequest], policy: str) -> dict:
    with tempfile.TemporaryDirectory() as d, cluster(args, n, model, Path(d), policy) as c:
        tmp = Path(d)
        pids = [c.procs[master_proc(i)].pid for i in range(len(c.masters))]
        ns_pid, fe_pid = c.procs["nameservice"].pid, c.procs["frontend"].pid
        rss0 = rss_bytes(pids[0])
        ns_cpu = None
        if "idle" not in args.skip:
            ns_cpu0, idle0 = cpu_s(ns_pid), time.monotonic()
            time.sleep(args.idle_s)
            ns_cpu = (cpu_s(ns_pid) - ns_cpu0) / (time.monotonic() - idle0)
        kv = KVNamespace.of(asyncio.run(members(c.nameservice))[0])
        probes = probe_requests(trace, args.probes, kv) if len(c.masters) > 1 else []
        before = [scrape(a) for a in c.master_metrics]
        fe_before = scrape(c.frontend)
        m_cpu0, fe_cpu0, t0 = sum(map(cpu_s, pids)), cpu_s(fe_pid), time.monotonic()
        load0 = os.getloadavg()[0]

        async def both() -> tuple[list[Result], dict]:
            start = time.monotonic() + 0.5  # the probes' hashes are ready: they start together
            runs = [replay(c.frontend, model.name, trace, start)]
            lead = args.probe_lead_s  # before their request's own route (or with it: 0)
            runs += [agreement(c.masters, probes, start - lead)] if probes else []
            results, *agreed = await asyncio.gather(*runs)
            return results, (agreed[0] if agreed else {})

        results, agreed = asyncio.run(both())
        wall = time.monotonic() - t0
        load1 = os.getloadavg()[0]
        time.sleep(1.0)  # the last events arrive
        after = [scrape(a) for a in c.master_metrics]
        fe_after = scrape(c.frontend)
        m_cpu, fe_cpu = sum(map(cpu_s, pids)) - m_cpu0, cpu_s(fe_pid) - fe_cpu0
        rss = rss_bytes(pids[0])
        routes_after, routes_before = merged(after), merged(before)
        blocks = total(after[0], "rtp:index_blocks")
        replay_only = minus(after[0], before[0])
        routes = total(routes_after, "rtp:route_decisions", "_total") - total(
            routes_before, "rtp:route_decisions", "_total"
        )
        events = total(after[0], "rtp:index_event_blocks", "_total") - total(
            before[0], "rtp:index_event_blocks", "_total"
        )
        # The master's TTFT prediction over the replay, as the frontend measured it (the
        # signed histogram has no _sum: its median; the frontend is new, so its whole life).
        family = "rtp:ttft_prediction_abs_error_seconds"
        count = total(fe_after, family, "_count") - total(fe_before, family, "_count")
        sum_ = total(fe_after, family, "_sum") - total(fe_before, family, "_sum")
        err = {
            "abs": sum_ / count if count else None,
            "signed": histogram_quantile(fe_after, "rtp:ttft_prediction_error_seconds", 0.5),
        }
        moved, capacity = {}, {}
        resync_s = out_s = None
        if "capacity" not in args.skip:
            asks = [r for _, r in probe_requests(trace, 50, kv)]
            for r in asks:
                r.frontend_id = ""  # no lease: each call a request of its own
            for batched in (False, True):
                capacity |= asyncio.run(route_capacity(
                    c, asks, args.capacity_s, args.capacity_concurrency, batched
                ))  # fmt: skip
        if len(c.masters) > 1 and "failover" not in args.skip:
            vocab = ModelConfig.from_dir(model).vocab_size
            moved = asyncio.run(failover(c, model.name, vocab, args.failover_rate, args.failover_s))
        if "restart" not in args.skip:
            log = Path(args.log_dir or tmp) / f"master-{n}.log"
            settle_s = 0.25 + 3 * args.event_cutoff_ms / 1000
            resync_s = asyncio.run(master_restart_s(c, log, settle_s, args.master_cpu))
        if "dead-worker" not in args.skip:
            out_s = asyncio.run(dead_worker_out_s(c, args, model, tmp))
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft_s for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "workers": n,
        "mode": args.mode,
        "policy": policy,
        "masters": len(c.masters),
        "requests": len(results),
        "failed": len(results) - len(ok),
        "replay_s": wall,
        "load_avg": (load0, load1),
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p95_s": _pct(ttfts, 95),
        "reuse": cached / max(1, prompt_tokens),
        "reuse_of_ceiling": cached / args.ceiling if args.ceiling else None,
        "prediction_abs_error_s": err["abs"],
        "prediction_error_s": err["signed"],
        "route_p50_s": histogram_quantile(routes_after, "rtp:route_duration_seconds", 0.5),
        "route_p99_s": histogram_quantile(routes_after, "rtp:route_duration_seconds", 0.99),
        "route_cpu_p99_s": histogram_quantile(routes_after, "rtp:route_cpu_seconds", 0.99),
        "routes": routes,
        "routes_per_master_cpu_s": routes / m_cpu if m_cpu else None,
        "master_gc": gc_pauses(replay_only),
        "master_cpu_s": m_cpu,
        "master_rss_mib": rss / 2**20,
        "index_blocks": blocks,
        "bytes_per_block": (rss - rss0) / blocks if blocks else None,
        "event_blocks_per_s": events / wall,
        # over the replay only (not the warm-up's burst of a thousand starting workers)
        "event_lag_p50_s": histogram_quantile(replay_only, "rtp:index_event_lag_seconds", 0.5),
        "event_lag_p99_s": histogram_quantile(replay_only, "rtp:index_event_lag_seconds", 0.99),
        "nameservice_cpu_pct": ns_cpu * 100 if ns_cpu is not None else None,
        "dead_worker_out_s": out_s,
        "master_resync_s": resync_s,
        **capacity,
        "frontend_req_per_cpu_s": len(ok) / fe_cpu if fe_cpu else None,
        "warm": c.warm,
        **agreed,
        **moved,
    }


def _capacity(r: dict, key: str = "capacity_") -> str | None:
    if key + "routes_per_s" not in r:
        return None
    cells = [
        _fmt(r[key + k]) for k in ("routes_per_s", "routes_per_cpu_s", "routes_per_routing_cpu_s")
    ]
    if key + "mean_batch" in r:
        cells.append(f"{r[key + 'mean_batch']:.1f} routes a call")
    return " / ".join(cells)


def _warm(r: dict) -> str | None:
    w = r.get("warm")
    if not w:
        return None
    return (f"{w['blocks']:.3g} / {w['seconds']:.1f} / {w['rate']:,.0f} / "
            f"{w['rss_per_block']:.1f}")  # fmt: skip


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


ROWS = (
    ("master route latency p50 (ms)", lambda r: r["route_p50_s"] and r["route_p50_s"] * 1e3),
    ("master route latency p99 (ms)", lambda r: r["route_p99_s"] and r["route_p99_s"] * 1e3),
    (
        "  of which on its thread's CPU, p99 (ms)",
        lambda r: r.get("route_cpu_p99_s") and r["route_cpu_p99_s"] * 1e3,
    ),
    ("routes / master CPU-second, over the replay", lambda r: r["routes_per_master_cpu_s"]),
    ("master GC over the replay: collections; ms in all; full; longest ≤ (ms)", lambda r: _gc(r)),
    ("master RSS (MiB)", lambda r: r["master_rss_mib"]),
    ("indexed blocks", lambda r: r["index_blocks"]),
    ("master RSS growth per indexed block (bytes)", lambda r: r["bytes_per_block"]),
    ("warm index: blocks / ingest (s) / blocks/s / RSS per block (bytes)", lambda r: _warm(r)),
    ("KV-event ingest (blocks/s over the replay)", lambda r: r["event_blocks_per_s"]),
    ("KV-event lag p50 / p99 (ms)", lambda r: _lag(r)),
    ("nameservice CPU, idle cluster (% of a core)", lambda r: r["nameservice_cpu_pct"]),
    ("SIGKILL to last routed (s)", lambda r: r["dead_worker_out_s"]),
    ("master SIGKILLed, restarted: full index again (s)", lambda r: r["master_resync_s"]),
    ("master capacity: routes/s; per CPU-s; per CPU-s less idle", lambda r: _capacity(r)),
    (
        "  the same through the frontend's route batcher",
        lambda r: _capacity(r, "capacity_batched_"),
    ),
    ("frontend requests / CPU-second", lambda r: r["frontend_req_per_cpu_s"]),
    ("replay: requests / failed", lambda r: f"{r['requests']} / {r['failed']}"),
    ("replay: wall (s); load average at start / end", lambda r: _wall(r)),
    ("TTFT p50 / p95 (s)", lambda r: f"{_fmt(r['ttft_p50_s'])} / {_fmt(r['ttft_p95_s'])}"),
    ("prefix reuse (cached / prompt tokens)", lambda r: r["reuse"]),
    ("prefix reuse / one-infinite-cache ceiling", lambda r: r["reuse_of_ceiling"]),
    ("master's TTFT prediction: mean |error| / median error (ms)", lambda r: _pred(r)),
    ("masters agreeing on the same request (probes)", lambda r: _agreed(r)),
    ("  disagreements with equal matched blocks", lambda r: r.get("disagree_same_match")),
    ("master SIGKILLed under load: requests after / failed / fallback", lambda r: _moved(r)),
    ("  TTFT p50 / max, ids hashing to the dead master (ms)", lambda r: _dead_first(r)),
    ("  TTFT p50, the other requests (ms)", lambda r: _ms(r.get("failover_ttft_others_p50_s"))),
)


def _ms(v: float | None) -> float | None:
    return v * 1e3 if v is not None else None


def _gc(r: dict) -> str | None:
    g = r.get("master_gc")
    if not g:
        return None
    return (f"{g['count']:.0f}; {g['seconds'] * 1e3:.1f}; {g['full']:.0f}; "
            f"{_fmt(g['longest_le_s'] * 1e3)}")  # fmt: skip


def _wall(r: dict) -> str:
    return f"{_fmt(r['replay_s'])}; {r['load_avg'][0]:.1f} / {r['load_avg'][1]:.1f}"


def _pred(r: dict) -> str:
    return f"{_fmt(_ms(r['prediction_abs_error_s']))} / {_fmt(_ms(r['prediction_error_s']))}"


def _agreed(r: dict) -> str | None:
    if r.get("agreement") is None:
        return None
    return f"{r['agreement']:.1%} of {r['probes'] - r['probe_failed']} ({r['probe_failed']} failed)"


def _moved(r: dict) -> str | None:
    if "failover_requests" not in r:
        return None
    return (f"{r['failover_requests']} / {r['failover_failed']} / "
            f"{_fmt(r['failover_fallback_routes'])}")  # fmt: skip


def _dead_first(r: dict) -> str | None:
    if "failover_requests" not in r:
        return None
    p50, top = r["failover_ttft_dead_first_p50_s"], r["failover_ttft_dead_first_max_s"]
    return f"{_fmt(_ms(p50))} / {_fmt(_ms(top))}"


def _lag(r: dict) -> str:
    p50, p99 = r["event_lag_p50_s"], r["event_lag_p99_s"]
    return f"{_fmt(p50 and p50 * 1e3)} / {_fmt(p99 and p99 * 1e3)}"


def table(r: dict) -> str:
    lines = [f"| N = {r['workers']} ({r['mode']}, {r['policy']}, {r['masters']} masters) | |",
             "|---|---|"]  # fmt: skip
    lines += [f"| {name} | {_fmt(get(r))} |" for name, get in ROWS]
    return "\n".join(lines)


def policy_table(results: list[dict]) -> str:
    """The policies side by side, per N, each against round_robin's run at the same N."""
    lines = [
        "| N | policy | TTFT p50 (s) | TTFT p95 (s) | p95 x rr | reuse | of ceiling | "
        "reuse x rr | prediction mean abs error (ms) | failed | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rr = {r["workers"]: r for r in results if r["policy"] == "round_robin"}
    for r in results:
        base = rr.get(r["workers"])
        p95 = r["ttft_p95_s"] / base["ttft_p95_s"] if base and base["ttft_p95_s"] else None
        reuse = r["reuse"] / base["reuse"] if base and base["reuse"] else None
        lines.append(
            f"| {r['workers']} {r['mode']} | {r['policy']} | {_fmt(r['ttft_p50_s'])} | "
            f"{_fmt(r['ttft_p95_s'])} | {_fmt(p95)} | {r['reuse']:.1%} | "
            f"{_fmt(r['reuse_of_ceiling'])} | {_fmt(reuse)} | "
            f"{_fmt(_ms(r['prediction_abs_error_s']))} | {r['failed']} | "
            f"{r['load_avg'][0]:.1f}-{r['load_avg'][1]:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="10,100")
    ap.add_argument("--mode", choices=("fused", "pd"), default="fused")
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument(
        "--policies", default=None,
        help="comma-separated policies: each N runs once per policy (default: --policy), "
        "and a last table compares them",
    )  # fmt: skip
    ap.add_argument("--masters", type=int, default=2, help="active-active master replicas")
    ap.add_argument(
        "--probe-lead-s", type=float, default=0.0,
        help="send each agreement probe this long before its request arrives (0: with it, "
        "racing that request's own route and its charge)",
    )  # fmt: skip
    ap.add_argument(
        "--event-cutoff-ms", type=float, default=0.0,
        help="the masters' --event-cutoff-ms (replicas route on the same events)",
    )  # fmt: skip
    ap.add_argument(
        "--probes", type=int, default=100,
        help="agreement probes over the replay (with 2 masters or more)",
    )  # fmt: skip
    ap.add_argument(
        "--master-cpu", type=int, default=None,
        help="pin the master replicas to this CPU and everything else to the others",
    )  # fmt: skip
    ap.add_argument("--failover-rate", type=float, default=20.0, help="requests/s, failover")
    ap.add_argument("--failover-s", type=float, default=3.0, help="failover window (s)")
    ap.add_argument(
        "--skip", default="",
        help=f"comma-separated measurements to leave out: {','.join(STEPS)}",
    )  # fmt: skip
    ap.add_argument(
        "--replay-only", action="store_true",
        help="the replay (and the masters' agreement) only: --skip all of them",
    )  # fmt: skip
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument(
        "--skip-requests", type=int, default=0,
        help="start this many requests into the trace (its later part shares more: the "
        "last 500 of its 3,993 could reuse 68%% of their prompt tokens, the first 500 9%%)",
    )  # fmt: skip
    ap.add_argument("--time-scale", type=float, default=0.05, help="arrival times multiplied")
    ap.add_argument("--max-output", type=int, default=8, help="output tokens at most")
    ap.add_argument("--max-input", type=int, default=0, help="cut prompts (0: real lengths)")
    ap.add_argument("--model", default="smollm2-135m", help="model dir or preset (config)")
    ap.add_argument("--cost", default=None, help="sim cost profile JSON (bench/fit_sim.py)")
    ap.add_argument(
        "--cost-scale", type=float, default=1.0,
        help="every step time of the profile multiplied (a slower model: loads the simulated "
        "workers at an arrival rate this machine's control plane keeps up with)",
    )  # fmt: skip
    ap.add_argument("--procs", type=int, default=2, help="sim-worker processes")
    ap.add_argument(
        "--num-blocks", type=int, default=0,
        help="KV blocks per worker (0: twice the longest request of the replay)",
    )  # fmt: skip
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--warm-blocks", type=int, default=0,
        help="each worker starts with this many cached blocks of synthetic prompts (the "
        "index at N x this many: 10,000 at N = 1,000 is 10M); measured as it is ingested",
    )  # fmt: skip
    ap.add_argument("--ttl", type=float, default=3.0, help="the nameservice's heartbeat TTL")
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle window for heartbeat CPU")
    ap.add_argument(
        "--capacity-s", type=float, default=5.0,
        help="window of back-to-back Route calls (and of idle before it) for the capacity row",
    )  # fmt: skip
    ap.add_argument(
        "--capacity-concurrency", type=int, default=8,
        help="routes in flight in the capacity rows (as many callers, back to back)",
    )  # fmt: skip
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--log-dir", default=None, help="keep the services' logs here")
    args = ap.parse_args(argv)
    args.skip = set(STEPS) if args.replay_only else set(filter(None, args.skip.split(",")))
    if args.skip - set(STEPS):
        ap.error(f"--skip: unknown {sorted(args.skip - set(STEPS))}")
    from rtp_serve.models.make_model import resolve_model

    source = resolve_model(args.model)
    vocab = ModelConfig.from_dir(source).vocab_size
    trace = load_trace(
        Path(args.trace),
        args.requests,
        args.time_scale,
        args.max_output,
        vocab,
        args.max_input,
        args.skip_requests,
    )
    context = max(len(t.prompt) + t.max_tokens for t in trace) + 1
    args.num_blocks = args.num_blocks or 2 * -(-context // args.block_size) + args.warm_blocks
    prompt_tokens = sum(len(t.prompt) for t in trace)
    args.ceiling = ceiling_tokens([t.prompt for t in trace], args.block_size)
    policies = (args.policies or args.policy).split(",")
    span = trace[-1].at_s if trace else 0.0
    print(
        f"# cpu flags: {cpu_flags()}; {os.cpu_count()} cores, shared: numbers are noisy; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"# trace: {len(trace)} requests of {args.trace} after its first "
          f"{args.skip_requests}, arrivals x{args.time_scale} "
          f"(over {span:.0f} s), outputs <= {args.max_output}; {prompt_tokens} prompt tokens, "
          f"the one-infinite-cache ceiling reuses {args.ceiling} "
          f"({args.ceiling / max(1, prompt_tokens):.1%}); mode {args.mode}, policies "
          f"{','.join(policies)}, {args.masters} master(s); cost "
          f"{args.cost or 'built-in default'} x{args.cost_scale}; "
          f"{args.num_blocks} blocks of {args.block_size} per worker")  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as d:
        model = sim_model(source, Path(d) / source.name, context)
        if args.cost_scale != 1.0:
            cost = SimCost.load(args.cost) if args.cost else SimCost()
            scaled = {f: getattr(cost, f) * args.cost_scale for f in
                      ("fixed_s", "prefill_token_s", "prefill_attn_s", "decode_row_s",
                       "decode_ctx_s")}  # fmt: skip
            args.cost = str(Path(d) / "sim_cost.json")
            SimCost(**scaled, source=f"{cost.source} x{args.cost_scale}").save(args.cost)
        for n in (int(x) for x in args.workers.split(",")):
            for policy in policies:
                r = run(args, n, model, trace, policy)
                results.append(r)
                print(table(r), flush=True)
        if len(policies) > 1:
            print(policy_table(results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
