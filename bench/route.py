"""Routing benchmark: the Mooncake trace, scaled down, replayed against launched clusters
under each routing policy, with the KV tiers on and off (the paper's Tables 2-3).

    python bench/route.py --num-requests 1000 --topologies fused:3,pd:2:1 \\
        --policies round_robin,least_load,cache_aware --tiers off,on [--reps 3]

Scaling (printed with the results): every 512-token block of the trace becomes
`--block-len` tokens built from its hash id (equal ids, equal tokens), output lengths are
scaled the same way, prompts are cut at `--max-input-len`, and the arrival times are
multiplied by `--time-scale`. Each run starts a fresh cluster (`rtp-serve up`), so no run
sees another's cache. With `--lead-requests N`, the N trace requests before the measured
ones are replayed first, their arrivals continuous with the measured ones', and every
number below leaves them out: the measured window starts warm (without it, the cold start
of an empty cluster, where no policy can reuse anything, is most of a 500-request p95).

Per run, over the measured requests: TTFT p50/p95/p99; reused prompt tokens (the sum of
usage.prompt_tokens_details.cached_tokens over the sum of prompt tokens); that reuse as a
share of the ceiling (what one infinite cache shared by everyone would reuse, computed
from the prompts, the lead-in's included: `ceiling_tokens`); the prompt blocks each tier
served, scraped from the workers' and cache service's metrics: T0 the pool of the worker
that computes the prompt (fused or prefill; what requests reused when admitted), T1 its
host-memory tier, T2 the cache service's memory, T3 Redis; and how well the master
predicted the time to first token, over the requests it predicted: the mean absolute
error in ms and the share it predicted too low ("late"). Those come from the frontend's
--log-requests lines (one per request, tagged by the X-Request-Id the benchmark sends),
which also give a second table: the prediction's terms beside what the worker measured
(the master's predicted wait, prefill and fetch; the worker's queue and prefill, and the
hops between), with the median of actual - predicted; `--dump DIR` keeps those lines per
request, as JSONL. A third table gives the CPU seconds each kind of process used
(/proc/PID/stat), so a policy or tier that costs more CPU than it saves shows where.
"tiers off" is `--no-cache --host-kv-cache-mib 0` (each worker's pool alone).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import aiohttp  # noqa: E402
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench import cpu_use  # noqa: E402
from bench.serve import cpu_info, medians, openai_stream, run_load, summarize  # noqa: E402
from bench.workload import SampleRequest, mooncake_requests, random_requests  # noqa: E402

TRACE = _ROOT.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"
TIERS = ("T0", "T1", "T2", "T3")
# (metric, tier label) -> our tier name; worker lookups, then the cache service's.
_TIER_SAMPLES = {
    ("rtp:prefix_cache_hits_total", "device"): "T0",
    ("rtp:prefix_cache_hits_total", "host"): "T1",
    ("rtp:cache_service_hits_total", "memory"): "T2",
    ("rtp:cache_service_hits_total", "redis"): "T3",
}


def ceiling_tokens(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """Prompt tokens one infinite prefix cache, shared by every worker, would serve: each
    prompt reuses its leading full blocks that an earlier prompt also had (as chained
    prefixes: a block counts only after all blocks before it), and at least its last token
    is always computed, as the engine does."""
    seen: set[tuple[int, ...]] = set()
    reused = 0
    for prompt in prompts:
        usable = (len(prompt) - 1) // block_size
        full = len(prompt) // block_size
        hit = True
        for i in range(full):
            key = tuple(prompt[: (i + 1) * block_size])
            if hit and i < usable and key in seen:
                reused += block_size
            else:
                hit = False
            seen.add(key)
    return reused


@dataclass(frozen=True, slots=True)
class Run:
    topology: str  # fused:K | pd:P:D
    tiers: bool
    policy: str
    variant: str = ""  # more launcher flags (--variants)

    @property
    def name(self) -> str:
        variant = f" [{self.variant}]" if self.variant else ""
        return f"{self.topology} tiers={'on' if self.tiers else 'off'}{variant} {self.policy}"

    def flags(self, args: argparse.Namespace) -> list[str]:
        kind, *n = self.topology.split(":")
        if kind == "fused" and len(n) == 1:
            out = ["--fused", n[0]]
        elif kind == "pd" and len(n) == 2:
            out = ["--prefill", n[0], "--decode", n[1]]
        else:
            raise SystemExit(f"topology {self.topology!r}: expected fused:K or pd:P:D")
        out += ["--policy", self.policy, "--kv-cache-mib", str(args.kv_cache_mib)]
        if self.tiers:
            out += ["--host-kv-cache-mib", str(args.host_kv_cache_mib)]
        else:
            out += ["--no-cache", "--host-kv-cache-mib", "0"]
        return out + shlex.split(args.launcher_args) + shlex.split(self.variant)


def tier_hits(addresses: Sequence[str]) -> dict[str, int]:
    """Blocks served per tier, summed over the given metrics endpoints, scraped all at once
    (one after another, a busy worker's late answer would move the others' reading)."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(addresses))) as pool:
        return count_tier_hits(pool.map(_scrape, addresses))


def count_tier_hits(texts: Iterable[str]) -> dict[str, int]:
    """Blocks served per tier, from the endpoints' Prometheus texts. The worker tiers count
    where a prompt is computed (fused and prefill workers): a PD decode worker's own copy-ups
    from its host tier save KV transfer, not prefill, and are left out. A worker's device
    hits include the blocks it copied up from its host tier: T0 is the rest."""
    hits = dict.fromkeys(TIERS, 0)
    for text in texts:
        mine = dict.fromkeys(TIERS, 0)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                tier = _TIER_SAMPLES.get((s.name, s.labels.get("tier", "")))
                if tier is not None and s.labels.get("role") != "decode":
                    mine[tier] += int(s.value)
        mine["T0"] = max(0, mine["T0"] - mine["T1"])
        hits = {t: hits[t] + mine[t] for t in TIERS}
    return hits


def _scrape(address: str) -> str:
    return httpx.get(f"http://{address}/metrics", timeout=10).text


def _metrics_addresses(nameservice: str) -> list[str]:
    from rtp_serve.services.common import grpc_util
    from rtp_serve.services.common.pb import nameservice_pb2 as ns
    from rtp_serve.services.common.pb import nameservice_pb2_grpc

    async def members() -> list:
        async with grpc_util.channel(nameservice) as ch:
            reply = await nameservice_pb2_grpc.NameServiceStub(ch).List(ns.ListRequest(), timeout=5)
            return list(reply.members)

    roles = {ns.ROLE_PREFILL, ns.ROLE_DECODE, ns.ROLE_FUSED, ns.ROLE_CACHE}
    return [m.metrics_address for m in asyncio.run(members()) if m.role in roles]


MEASURED, LEAD = "req-", "lead-"  # X-Request-Id prefixes: measured, lead-in


async def _replay(
    url: str,
    requests: list[SampleRequest],
    warm: list[SampleRequest],
    lead: int,
    at_start: Callable[[], object],
):
    """Replays `requests` at their arrival times, each with its own X-Request-Id (LEAD and
    its index for the first `lead` of them, MEASURED for the rest); `at_start` runs on
    another thread as the first measured request is sent. Returns the measured requests'
    results, the wall time, their usage's cached tokens summed, and what `at_start`
    returned."""
    timeout = aiohttp.ClientTimeout(total=None)
    cached = [0] * len(requests)
    index = {id(r.prompt): i for i, r in enumerate(requests)}
    started: list[asyncio.Future] = []
    # A thread of its own: the loop's default executor also resolves the connections' hosts,
    # and a snapshot queued behind a burst of those would count late.
    own = concurrent.futures.ThreadPoolExecutor(1)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{url}/v1/models") as reply:
            model = (await reply.json())["data"][0]["id"]
        await run_load(openai_stream(url, model, session), warm, [0.0] * len(warm))

        async def stream(prompt: list[int], max_tokens: int, tick) -> int:
            i, box = index[id(prompt)], []
            if i == lead:  # (not awaited here: the request goes out on time)
                started.append(asyncio.get_running_loop().run_in_executor(own, at_start))
            rid = f"{LEAD if i < lead else MEASURED}{i}"
            one = openai_stream(url, model, session, box, headers={"X-Request-Id": rid})
            n = await one(prompt, max_tokens, tick)
            cached[i] = box[0] if box else 0
            return n

        results, duration = await run_load(stream, requests, [r.arrival_s for r in requests])
        snapshot = await started[0] if started else None
    own.shutdown()
    return results[lead:], duration, sum(cached[lead:]), snapshot


_FIRST_TOKEN = "first token: "


def first_token_lines(log_text: str) -> list[dict[str, str]]:
    """The frontend's --log-requests lines ("first token: key=value ..."; text or JSON
    log format), as dicts."""
    out = []
    for line in log_text.splitlines():
        if line.startswith("{"):
            try:
                line = json.loads(line).get("msg", "")
            except ValueError:
                continue
        _, found, rest = line.partition(_FIRST_TOKEN)
        if found:
            out.append(dict(kv.split("=", 1) for kv in rest.split() if "=" in kv))
    return out


def prediction_terms(records: Sequence[dict[str, str]]) -> dict[str, float]:
    """Mean seconds of each term of the master's prediction beside what it came to, over
    the requests it predicted: the wait against the worker's queue (its prefix fetch
    included), the prefill (and fetch) against the worker's prefill, and the hops (the
    actual time to first token less the worker's queue and prefill: frontend to worker
    and back, and the prefill worker to the decode worker in PD); and the error of the
    whole: its mean absolute value, the share predicted too low ("late") and the median of
    actual - predicted."""
    keys = ("predicted_s", "predicted_wait_s", "predicted_prefill_s", "predicted_fetch_s",
            "actual_s", "queue_s", "prefill_s")  # fmt: skip
    rows = [{k: float(r[k]) for k in keys} for r in records if float(r["predicted_s"]) > 0]
    if not rows:
        return {}
    out = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    out["hops_s"] = statistics.fmean(r["actual_s"] - r["queue_s"] - r["prefill_s"] for r in rows)
    errors = [r["actual_s"] - r["predicted_s"] for r in rows]
    out["median_error_s"] = statistics.median(errors)
    out["abs_error_s"] = statistics.fmean(abs(e) for e in errors)
    out["late"] = sum(e > 0 for e in errors) / len(errors)
    out["predicted"] = len(rows)
    return out


def run_one(run: Run, model: str, requests, warm, args, lead: int = 0) -> dict:
    from rtp_serve.services.launcher.process import launch

    flags = [*run.flags(args), "--log-requests"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(Path(tmp) / "cluster.log", "w+") as log, launch(model, Path(tmp), *flags,
                                                                   stderr=log) as c:  # fmt: skip
            addresses = _metrics_addresses(c.info["nameservice"])

            def counters() -> tuple[dict[str, float], dict[str, int], float]:
                """The counters, and the seconds their scrape took."""
                started = time.perf_counter()
                processes = cpu_use.of_cluster(c.info["pids"])
                cpu = cpu_use.snapshot(processes, engine_apart=False)  # each process whole
                hits = tier_hits(addresses)
                return cpu, hits, time.perf_counter() - started

            replay = _replay(c.url, requests, warm, lead, counters)
            results, duration, cached, before = asyncio.run(replay)
            cpu_before, hits_before, scrape_s = before or ({}, {}, 0.0)
            cpu_after, hits_after, _ = counters()
        lines = first_token_lines((Path(tmp) / "cluster.log").read_text(errors="replace"))
        records = [r for r in lines if r.get("request", "").startswith(MEASURED)]
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        name = run.name.replace(" ", "_").replace(":", "-").replace("=", "-")
        with open(Path(args.dump) / f"{name}.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    out = summarize(results, duration, (50, 95, 99))
    terms = prediction_terms(records)
    return out | {
        "cached_tokens": cached,
        "hits": {t: hits_after[t] - hits_before.get(t, 0) for t in hits_after},
        "snapshot_s": scrape_s,
        "prediction_abs_error_s": terms.get("abs_error_s", math.nan),
        "prediction_late": terms.get("late", math.nan),
        "terms": terms,
        "cpu_s": {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after},
    }


def median_of(reps: Sequence[dict]) -> dict:
    """One row from several runs of the same configuration: the median of each number
    (bench/serve.py's medians), per tier and per process for the nested ones, where a
    repetition without a tier or process counts 0 for it; failures are summed."""
    out = medians(reps)
    for nested in ("hits", "cpu_s", "terms"):
        keys = {k for r in reps for k in r.get(nested, {})}
        out[nested] = {k: statistics.median([r.get(nested, {}).get(k, 0.0) for r in reps])
                       for k in keys}  # fmt: skip
    return out


def ratios(reps: Sequence[dict], base: Sequence[dict], key: str) -> list[float]:
    """Each repetition's `key` over the same repetition of its baseline."""
    return [a[key] / b[key] for a, b in zip(reps, base, strict=False) if b[key]]


def paired(rows: dict[Run, list[dict]]) -> list[str]:
    """Each repetition's ratio to its pair (runs are interleaved, so a pair shares the
    machine's state): TTFT p95 against round_robin's, and the tiers-on run's p50 speed-up
    over tiers off (the issue's two targets; the table gives their medians)."""
    out = []
    for run, reps in rows.items():
        pairs = []
        if run.policy != "round_robin":
            rr = rows.get(dataclasses.replace(run, policy="round_robin"), [])
            pairs.append(("p95 x rr", ratios(reps, rr, "p95_ttft_ms")))
        if run.tiers:
            off = rows.get(dataclasses.replace(run, tiers=False), [])
            pairs.append(
                ("p50 off / on", [1 / x for x in ratios(reps, off, "median_ttft_ms") if x])
            )
        out += [f"{run.name}: {label} by repetition " + " ".join(f"{v:.2f}" for v in values)
                for label, values in pairs if len(values) > 1]  # fmt: skip
    return ["\nEach repetition against its pair", *out] if out else []


def table(rows: dict[Run, list[dict]], prompt_tokens: int, ceiling: int) -> str:
    """The results, one line per configuration; with several repetitions, each number is
    the median over them, and "p95 x rr" is the median of each repetition's ratio to the
    round_robin run of the same repetition (runs are interleaved, so a pair shares the
    machine's state), with its range."""
    w = max([36, *(len(run.name) for run in rows)])  # the run column's width
    head = (
        f"{'run':<{w}} {'reps':>4} {'ok':>5} {'fail':>4} {'TTFT p50':>9} {'p95':>8} {'p99':>8} "
        f"{'ITL p99':>8} "
        f"{'p95 x rr':>8} {'range':>11} {'reused':>7} {'of ceil':>7} {'|err| ms':>8} "
        f"{'late':>5} " + " ".join(f"{t:>6}" for t in TIERS)
    )
    lines = [head]
    rr = {(r.topology, r.tiers, r.variant): v for r, v in rows.items() if r.policy == "round_robin"}
    merged = {run: median_of(reps) for run, reps in rows.items()}
    for run, reps in rows.items():
        r = merged[run]
        base = rr.get((run.topology, run.tiers, run.variant), [])
        p95s = ratios(reps, base, "p95_ttft_ms")
        ratio = statistics.median(p95s) if p95s else math.nan
        spread = f"{min(p95s):.2f}-{max(p95s):.2f}" if len(p95s) > 1 else ""
        reused = r["cached_tokens"] / prompt_tokens if prompt_tokens else 0.0
        share = r["cached_tokens"] / ceiling if ceiling else math.nan
        tiers = " ".join(f"{r['hits'].get(t, 0):>6.0f}" for t in TIERS)
        lines.append(
            f"{run.name:<{w}} {len(reps):>4} {r['completed']:>5.0f} {r['failed']:>4} "
            f"{r['median_ttft_ms']:>9.1f} {r['p95_ttft_ms']:>8.1f} {r['p99_ttft_ms']:>8.1f} "
            f"{r['p99_itl_ms']:>8.1f} "
            f"{ratio:>8.2f} {spread:>11} {reused:>7.1%} {share:>7.1%} "
            f"{r['prediction_abs_error_s'] * 1e3:>8.0f} {r['prediction_late']:>5.0%} {tiers}"
        )
    lines += paired(rows)
    lines.append(
        "\nThe master's prediction term by term, mean ms over the requests it predicted: "
        "predicted (wait + prefill + fetch) against actual (the worker's queue + its prefill "
        f"+ hops), and the median of actual - predicted\n{'run':<{w}} {'n':>5} {'pred':>7} {'wait':>7} {'prefill':>7} {'fetch':>7} "
        f"{'actual':>7} {'queue':>7} {'prefill':>7} {'hops':>7} {'err p50':>7}"
    )
    for run, r in merged.items():
        t = r.get("terms") or {}
        if not t:
            continue
        ms = [t[k] * 1e3 for k in ("predicted_s", "predicted_wait_s", "predicted_prefill_s",
                                   "predicted_fetch_s", "actual_s", "queue_s", "prefill_s",
                                   "hops_s", "median_error_s")]  # fmt: skip
        lines.append(
            f"{run.name:<{w}} {t['predicted']:>5.0f} " + " ".join(f"{v:>7.1f}" for v in ms)
        )
    names = sorted({n for r in merged.values() for n in r["cpu_s"]})
    lines.append(f"\nCPU seconds used during the replay, by process\n{'run':<{w}} "
                 + " ".join(f"{n[:10]:>10}" for n in names))  # fmt: skip
    for run, r in merged.items():
        cpu = r["cpu_s"]
        lines.append(f"{run.name:<{w}} " + " ".join(f"{cpu.get(n, 0.0):>10.1f}" for n in names))
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model dir or preset name")
    ap.add_argument("--dataset-path", default=str(TRACE))
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument(
        "--skip-requests", type=int, default=0,
        help="start this many lines into the trace (its later part reuses more: the last "
        "1000 of its 3993 requests share 68%% of their blocks among themselves, the first 1000 17%%)",
    )  # fmt: skip
    ap.add_argument(
        "--lead-requests", type=int, default=0,
        help="replay this many trace requests before the measured ones first, arrivals "
        "continuous, and leave them out of every number: the measured window starts warm "
        "(caches filled, cost models fitted, queues in their steady state), not cold",
    )  # fmt: skip
    ap.add_argument("--block-len", type=int, default=16, help="tokens per 512-token trace block")
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=0.5, help="x the trace's arrival times")
    ap.add_argument("--topologies", default="fused:3,pd:2:1")
    ap.add_argument("--policies", default="round_robin,least_load,cache_aware")
    ap.add_argument("--tiers", default="off,on", help="off, on, or both")
    ap.add_argument("--kv-cache-mib", default="64", help="T0 per worker (the launcher's flag)")
    ap.add_argument("--host-kv-cache-mib", type=int, default=256, help="T1 per worker, tiers on")
    ap.add_argument("--launcher-args", default="", help="more `rtp-serve up` flags, one string")
    ap.add_argument(
        "--variants", default="",
        help="';'-separated sets of more launcher flags to compare, each run with every "
        "policy (an empty one: none), e.g. '; --max-num-seqs 16'",
    )  # fmt: skip
    ap.add_argument(
        "--dump",
        default="",
        help="a directory: each run's per-request lines "
        "(worker, predicted and actual time to first token, term by term) as JSONL",
    )
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--reps", type=int, default=1,
        help="run every configuration this many times, interleaved (each repetition runs all "
        "of them in turn); the table shows medians. One run on a shared 2-core box varies by 2x",
    )  # fmt: skip
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[Run, list[dict]]:
    args = parse_args(argv)
    from rtp_serve.core.model_config import ModelConfig
    from rtp_serve.models.make_model import resolve_model

    model = str(resolve_model(args.model))
    vocab = min(args.vocab, ModelConfig.from_dir(model).vocab_size)
    lead = min(args.lead_requests, args.skip_requests)
    replayed = mooncake_requests(
        args.dataset_path, vocab, args.block_len, args.num_requests + lead, args.max_input_len,
        args.max_output_len, args.time_scale, args.seed, args.skip_requests - lead,
    )  # fmt: skip
    warm = random_requests(2, 16, 4, vocab, args.seed + 1)
    requests = replayed[lead:]
    prompt_tokens = sum(len(r.prompt) for r in requests)
    block_size = 16  # the engine's KV block (EngineConfig.block_size)
    # What one infinite cache would give the measured requests, the lead-in's prompts seen.
    prompts = [r.prompt for r in replayed]
    ceiling = ceiling_tokens(prompts, block_size) - ceiling_tokens(prompts[:lead], block_size)
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    print(f"# CPU ISA: {cpu_info()['describe']}")
    print(f"# model {model}; trace {args.dataset_path}: {len(requests)} requests measured after "
          f"its first {args.skip_requests}, the {lead} before them replayed first as a lead-in "
          f"(unmeasured, arrivals continuous), "
          f"512-token blocks -> {args.block_len} tokens, prompts cut at {args.max_input_len}, "
          f"outputs at {args.max_output_len}, arrivals x{args.time_scale} (over {span:.0f} s); "
          f"{prompt_tokens} prompt tokens; ceiling {ceiling} reusable "
          f"({ceiling / max(1, prompt_tokens):.1%}); T0 {args.kv_cache_mib} MiB/worker, "
          f"T1 {args.host_kv_cache_mib} MiB/worker with tiers on")  # fmt: skip
    variants = [v.strip() for v in args.variants.split(";")]
    rows: dict[Run, list[dict]] = {}
    for rep in range(args.reps):
        for topology in args.topologies.split(","):
            for tiers in args.tiers.split(","):
                for variant, policy in itertools.product(variants, args.policies.split(",")):
                    run = Run(topology, tiers == "on", policy, variant)
                    label = f"{run.name} (repetition {rep + 1}/{args.reps})"
                    print(f"# {label}: running", file=sys.stderr, flush=True)
                    try:
                        result = run_one(run, model, replayed, warm, args, lead)
                    except Exception as exc:  # one run that cannot start does not cost the others
                        print(f"# {label}: skipped, {type(exc).__name__}: {exc}", file=sys.stderr)
                        continue
                    rows.setdefault(run, []).append(result)
                    print(f"# {label}: counters scraped at the first measured request in "
                          f"{result['snapshot_s'] * 1e3:.0f} ms", file=sys.stderr)  # fmt: skip
                    for err in result.get("error_kinds", []):
                        print(f"# {label}: failed: {err}", file=sys.stderr)
                    # the table so far: a long sweep shows its progress
                    print(table(rows, prompt_tokens, ceiling), file=sys.stderr, flush=True)
    print(table(rows, prompt_tokens, ceiling))
    return rows


if __name__ == "__main__":
    main()
