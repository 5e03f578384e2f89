"""The control plane at scale: real NATS, nameservice, master and frontend in front of N
simulated workers (`rtp-serve sim-worker`), the Mooncake trace at its real token lengths.

    python bench/scale.py --workers 10,100,1000 [--requests 1000] [--time-scale 0.05]
        [--cost sim_cost.json] [--mode fused|pd] [--max-output 8] [--procs 4]

Per N, one table:
  - master route latency p50/p99, server side (rtp:route_duration_seconds, interpolated
    within its histogram buckets), and routes per master CPU-second;
  - master RSS, the prefix index's blocks, and RSS growth per indexed block;
  - KV-event ingest at the master (blocks/s over the replay) and its lag behind the
    workers' publishing (rtp:index_event_lag_seconds, p50/p99);
  - nameservice CPU (% of one core) under N heartbeats, idle cluster;
  - time from a worker's SIGKILL to the last request the master routed to it;
  - the frontend's completed requests per CPU-second;
  - the replay: requests, failures, TTFT p50/p95, prefix reuse.
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
from rtp_serve.services.common import grpc_util  # noqa: E402
from rtp_serve.services.common.convert import params_to_pb  # noqa: E402
from rtp_serve.services.common.pb import (  # noqa: E402
    master_pb2,
    master_pb2_grpc,
    nameservice_pb2,
    nameservice_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from rtp_serve.services.launcher.servers import free_port, start_nats  # noqa: E402

TRACE = _ROOT.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"
TRACE_BLOCK = 512  # tokens per hash id in the trace


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at_s: float
    prompt: list[int]
    max_tokens: int


def load_trace(
    path: Path, n: int, time_scale: float, max_output: int, vocab: int, max_input: int = 0
) -> list[TraceRequest]:
    out = []
    with path.open() as f:
        for line in f:
            if len(out) >= n:
                break
            row = json.loads(line)
            prompt: list[int] = []
            for h in row["hash_ids"]:
                prompt += [(h * 7919 + j * 31 + 1) % vocab for j in range(TRACE_BLOCK)]
            prompt = prompt[: min(row["input_length"], max_input or row["input_length"])]
            tokens = max(1, min(row["output_length"], max_output))
            out.append(TraceRequest(row["timestamp"] / 1000 * time_scale, prompt, tokens))
    return out


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
    text = httpx.get(f"http://{address}/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def total(metrics: dict[str, list], family: str, suffix: str = "") -> float:
    return sum(s.value for s in metrics.get(family, []) if s.name == family + suffix)


def histogram_quantile(metrics: dict[str, list], family: str, q: float) -> float | None:
    """The q-quantile of a histogram, interpolated linearly within its bucket."""
    buckets = sorted(
        (float(s.labels["le"]), s.value)
        for s in metrics.get(family, [])
        if s.name == family + "_bucket"
    )
    if not buckets or buckets[-1][1] == 0:
        return None
    rank, prev_le, prev_n = q * buckets[-1][1], 0.0, 0.0
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
    master: str
    master_metrics: str
    frontend: str
    procs: dict[str, subprocess.Popen]
    workers: list[subprocess.Popen]


@contextlib.contextmanager
def cluster(args, n: int, model: Path, tmp: Path) -> Iterator[ScaleCluster]:
    log = Path(args.log_dir or tmp) / f"services-{n}.log"
    nats = start_nats(tmp)
    procs: dict[str, subprocess.Popen] = {}
    workers: list[subprocess.Popen] = []
    try:
        ns_port, m_port, m_metrics, fe_port = (free_port() for _ in range(4))
        ns, master = f"127.0.0.1:{ns_port}", f"127.0.0.1:{m_port}"
        common = ("--nats-url", nats.url, "--log-level", "WARNING")
        procs["nameservice"] = spawn(
            "nameservice", "--port", str(ns_port), "--ttl", str(args.ttl), *common, log=log
        )
        procs["master"] = spawn(
            "master", "--port", str(m_port), "--nameservice", ns, "--metrics-port",
            str(m_metrics), "--policy", args.policy, *common, log=log,
        )  # fmt: skip
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
                        *(("--cost", args.cost) if args.cost else ()), *common, log=log,
                    )
                )  # fmt: skip
        asyncio.run(wait_members(ns, n, timeout=60 + n * 0.2))
        procs["frontend"] = spawn(
            "frontend", "--port", str(fe_port), "--nameservice", ns, "--master", master,
            "--model", str(model), "--log-level", "WARNING", "--max-concurrent", "100000",
            "--max-streams-per-client", "0", log=log,
        )  # fmt: skip
        asyncio.run(wait_ready(f"127.0.0.1:{fe_port}"))
        yield ScaleCluster(
            nats.url, ns, master, f"127.0.0.1:{m_metrics}", f"127.0.0.1:{fe_port}", procs, workers
        )
    finally:
        for proc in [*workers, *reversed(procs.values())]:
            stop(proc)
        nats.stop()


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


async def replay(frontend: str, model: str, trace: list[TraceRequest]) -> list[Result]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=f"http://{frontend}", timeout=600, limits=limits) as http:
        start = time.monotonic()

        async def one(req: TraceRequest) -> Result:
            await asyncio.sleep(max(0.0, start + req.at_s - time.monotonic()))
            sent = time.monotonic()
            body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            ttft, usage = None, {}
            try:
                async with http.stream("POST", "/v1/completions", json=body) as reply:
                    if reply.status_code != 200:
                        return Result(False, 0.0, len(req.prompt), 0)
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if ttft is None and chunk.get("choices"):
                            ttft = time.monotonic() - sent
                        usage = chunk.get("usage") or usage
            except httpx.HTTPError:
                return Result(False, 0.0, len(req.prompt), 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            return Result(ttft is not None, ttft or 0.0, len(req.prompt), cached or 0)

        return await asyncio.gather(*(one(r) for r in trace))


# -- a restarted master -----------------------------------------------------------------
async def index_pairs(master: str) -> int | None:
    """(worker, block) pairs in the master's index (None: it does not answer)."""
    try:
        async with grpc_util.channel(master) as ch:
            reply = await master_pb2_grpc.MasterStub(ch).Index(master_pb2.IndexRequest(), timeout=5)
    except grpc.aio.AioRpcError:
        return None
    return sum(len(w.block_hashes) for w in reply.workers)


async def master_restart_s(c: ScaleCluster, log: Path, timeout: float = 300.0) -> float | None:
    """SIGKILL the master and start it again on its port: seconds until its index holds
    every pair the old one held (the idle workers hold what they held), from snapshots."""
    held = await index_pairs(c.master)
    old = c.procs["master"]
    old.kill()
    old.wait()
    started = time.monotonic()
    out = log.open("ab")
    c.procs["master"] = subprocess.Popen(old.args, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    while time.monotonic() - started < timeout:
        if await index_pairs(c.master) == held:
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
def run(args, n: int, model: Path, trace: list[TraceRequest]) -> dict:
    with tempfile.TemporaryDirectory() as d, cluster(args, n, model, Path(d)) as c:
        tmp = Path(d)
        master_pid, ns_pid = c.procs["master"].pid, c.procs["nameservice"].pid
        fe_pid = c.procs["frontend"].pid
        rss0 = rss_bytes(master_pid)
        ns_cpu0, idle0 = cpu_s(ns_pid), time.monotonic()
        time.sleep(args.idle_s)
        ns_cpu = (cpu_s(ns_pid) - ns_cpu0) / (time.monotonic() - idle0)
        before = scrape(c.master_metrics)
        m_cpu0, fe_cpu0, t0 = cpu_s(master_pid), cpu_s(fe_pid), time.monotonic()
        results = asyncio.run(replay(c.frontend, model.name, trace))
        wall = time.monotonic() - t0
        time.sleep(1.0)  # the last events arrive
        after = scrape(c.master_metrics)
        m_cpu, fe_cpu = cpu_s(master_pid) - m_cpu0, cpu_s(fe_pid) - fe_cpu0
        rss = rss_bytes(master_pid)
        blocks = total(after, "rtp:index_blocks")
        routes = total(after, "rtp:route_decisions", "_total") - total(
            before, "rtp:route_decisions", "_total"
        )
        events = total(after, "rtp:index_event_blocks", "_total") - total(
            before, "rtp:index_event_blocks", "_total"
        )
        resync_s = asyncio.run(master_restart_s(c, Path(args.log_dir or tmp) / f"master-{n}.log"))
        out_s = asyncio.run(dead_worker_out_s(c, args, model, tmp))
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft_s for r in ok)
    return {
        "workers": n,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "replay_s": wall,
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p95_s": _pct(ttfts, 95),
        "reuse": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "route_p50_s": histogram_quantile(after, "rtp:route_duration_seconds", 0.5),
        "route_p99_s": histogram_quantile(after, "rtp:route_duration_seconds", 0.99),
        "routes": routes,
        "routes_per_master_cpu_s": routes / m_cpu if m_cpu else None,
        "master_cpu_s": m_cpu,
        "master_rss_mib": rss / 2**20,
        "index_blocks": blocks,
        "bytes_per_block": (rss - rss0) / blocks if blocks else None,
        "event_blocks_per_s": events / wall,
        "event_lag_p50_s": histogram_quantile(after, "rtp:index_event_lag_seconds", 0.5),
        "event_lag_p99_s": histogram_quantile(after, "rtp:index_event_lag_seconds", 0.99),
        "nameservice_cpu_pct": ns_cpu * 100,
        "dead_worker_out_s": out_s,
        "master_resync_s": resync_s,
        "frontend_req_per_cpu_s": len(ok) / fe_cpu if fe_cpu else None,
    }


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
    ("routes / master CPU-second", lambda r: r["routes_per_master_cpu_s"]),
    ("master RSS (MiB)", lambda r: r["master_rss_mib"]),
    ("indexed blocks", lambda r: r["index_blocks"]),
    ("master RSS growth per indexed block (bytes)", lambda r: r["bytes_per_block"]),
    ("KV-event ingest (blocks/s over the replay)", lambda r: r["event_blocks_per_s"]),
    ("KV-event lag p50 / p99 (ms)", lambda r: _lag(r)),
    ("nameservice CPU, idle cluster (% of a core)", lambda r: r["nameservice_cpu_pct"]),
    ("SIGKILL to last routed (s)", lambda r: r["dead_worker_out_s"]),
    ("master SIGKILLed, restarted: full index again (s)", lambda r: r["master_resync_s"]),
    ("frontend requests / CPU-second", lambda r: r["frontend_req_per_cpu_s"]),
    ("replay: requests / failed", lambda r: f"{r['requests']} / {r['failed']}"),
    ("replay: wall (s)", lambda r: r["replay_s"]),
    ("TTFT p50 / p95 (s)", lambda r: f"{_fmt(r['ttft_p50_s'])} / {_fmt(r['ttft_p95_s'])}"),
    ("prefix reuse (cached / prompt tokens)", lambda r: r["reuse"]),
)


def _lag(r: dict) -> str:
    p50, p99 = r["event_lag_p50_s"], r["event_lag_p99_s"]
    return f"{_fmt(p50 and p50 * 1e3)} / {_fmt(p99 and p99 * 1e3)}"


def table(r: dict) -> str:
    lines = [f"| N = {r['workers']} | |", "|---|---|"]
    lines += [f"| {name} | {_fmt(get(r))} |" for name, get in ROWS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="10,100")
    ap.add_argument("--mode", choices=("fused", "pd"), default="fused")
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--time-scale", type=float, default=0.05, help="arrival times multiplied")
    ap.add_argument("--max-output", type=int, default=8, help="output tokens at most")
    ap.add_argument("--max-input", type=int, default=0, help="cut prompts (0: real lengths)")
    ap.add_argument("--model", default="smollm2-135m", help="model dir or preset (config)")
    ap.add_argument("--cost", default=None, help="sim cost profile JSON (bench/fit_sim.py)")
    ap.add_argument("--procs", type=int, default=2, help="sim-worker processes")
    ap.add_argument(
        "--num-blocks", type=int, default=0,
        help="KV blocks per worker (0: twice the longest request of the replay)",
    )  # fmt: skip
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--ttl", type=float, default=3.0, help="the nameservice's heartbeat TTL")
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle window for heartbeat CPU")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--log-dir", default=None, help="keep the services' logs here")
    args = ap.parse_args(argv)
    from rtp_serve.models.make_model import resolve_model

    source = resolve_model(args.model)
    vocab = ModelConfig.from_dir(source).vocab_size
    trace = load_trace(
        Path(args.trace), args.requests, args.time_scale, args.max_output, vocab, args.max_input
    )
    context = max(len(t.prompt) + t.max_tokens for t in trace) + 1
    args.num_blocks = args.num_blocks or 2 * -(-context // args.block_size)
    print(f"# cpu flags: {cpu_flags()}; {os.cpu_count()} cores, shared: numbers are noisy")
    print(f"# trace: {len(trace)} requests of {args.trace}, arrivals x{args.time_scale}, "
          f"outputs <= {args.max_output}; mode {args.mode}, policy {args.policy}; "
          f"cost {args.cost or 'built-in default'}")  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as d:
        model = sim_model(source, Path(d) / source.name, context)
        for n in (int(x) for x in args.workers.split(",")):
            r = run(args, n, model, trace)
            results.append(r)
            print(table(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
