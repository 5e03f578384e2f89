"""Serving benchmark: a load client for any OpenAI-compatible endpoint (in the manner of
`vllm bench serve`), and a comparison of the in-process engine with launched clusters.

    # one endpoint
    python bench/serve.py --url http://127.0.0.1:8000 --num-requests 64 --concurrency 16
    # the comparison the issue asks for: engine vs PD cluster vs fused cluster, in one run
    python bench/serve.py --compare --model smollm2-135m   # a preset name or a directory

Prompts are token ids (exact lengths), with `--shared-prefix` of each prompt common to all
requests. `--request-rate` sends a Poisson stream instead of fixed concurrency. Prints a
JSON result per target (TTFT, TPOT, ITL, E2E: mean/p50/p90/p99; request and output token
throughput) and, with --compare, a table of ratios against the in-process engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import aiohttp  # noqa: E402
from tqdm import tqdm  # noqa: E402


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str = ""


Stream = Callable[[list[int], int], AsyncIterator[int]]  # yields token counts per chunk


def make_prompts(
    n: int, length: int, shared_fraction: float, vocab: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(int(length * shared_fraction))]
    return [
        shared + [rng.randrange(10, vocab) for _ in range(length - len(shared))] for _ in range(n)
    ]


def openai_stream(url: str, model: str, session: aiohttp.ClientSession) -> Stream:
    async def stream(prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:200]}")
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    yield 1  # one chunk per token with greedy streaming

    return stream


def engine_stream(llm) -> Stream:
    from engine import SamplingParams

    async def stream(prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for out in llm.generate(prompt, params):
            if out.new_token_ids:
                yield len(out.new_token_ids)

    return stream


async def run_one(stream: Stream, prompt: list[int], max_tokens: int) -> RequestResult:
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async for n in stream(prompt, max_tokens):
            now = time.perf_counter()
            if result.output_tokens == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            result.output_tokens += n
            last = now
        result.ok = True
    except Exception as exc:  # a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - start
    return result


async def run_load(
    stream: Stream,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    rate: float | None,
    seed: int,
) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), file=sys.stderr, leave=False)
    rng = random.Random(seed)

    async def guarded(prompt):
        async with sem:
            r = await run_one(stream, prompt, max_tokens)
        bar.update(1)
        return r

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(guarded(prompt)))
        if rate:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    bar.close()
    return results, time.perf_counter() - start


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(values)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]

    return {
        "mean": statistics.fmean(s) * 1e3,
        "p50": pct(50) * 1e3,
        "p90": pct(90) * 1e3,
        "p99": pct(99) * 1e3,
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "ttft_ms": _pcts([r.ttft for r in ok]),
        "tpot_ms": _pcts(tpot),
        "itl_ms": _pcts([g for r in ok for g in r.itl]),
        "e2e_ms": _pcts([r.e2e for r in ok]),
    }


async def bench_url(url: str, prompts, args) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(f"{url}/v1/models") as reply:
            model = (await reply.json())["data"][0]["id"]
        stream = openai_stream(url, model, session)
        await run_load(stream, prompts[:2], 4, 2, None, args.seed)  # warm-up
        results, duration = await run_load(
            stream, prompts, args.output_len, args.concurrency, args.request_rate, args.seed
        )
    return summarize(results, duration)


async def bench_engine(model: str, prompts, args) -> dict:
    from engine import AsyncLLM, EngineConfig

    llm = AsyncLLM(EngineConfig(model=model, kv_cache_memory_bytes=args.kv_cache_mib << 20))
    try:
        stream = engine_stream(llm)
        await run_load(stream, prompts[:2], 4, 2, None, args.seed)
        results, duration = await run_load(
            stream, prompts, args.output_len, args.concurrency, args.request_rate, args.seed
        )
    finally:
        llm.shutdown()
    return summarize(results, duration)


def compare(args) -> dict[str, dict]:
    from engine.make_model import resolve_model
    from services.launcher.process import launch

    model = str(resolve_model(args.model or args.model_preset))
    prompts = make_prompts(
        args.num_requests, args.input_len, args.shared_prefix, args.vocab, args.seed
    )
    out = {"engine": asyncio.run(bench_engine(model, prompts, args))}
    kv = ["--kv-cache-mib", str(args.kv_cache_mib)]
    for name, flags in (("pd", ["--prefill", "1", "--decode", "1"]), ("fused", ["--fused", "1"])):
        with tempfile.TemporaryDirectory() as tmp, launch(model, Path(tmp), *flags, *kv) as cluster:
            out[name] = asyncio.run(bench_url(cluster.url, prompts, args))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", help="an OpenAI-compatible endpoint (http://host:port)")
    ap.add_argument("--compare", action="store_true", help="engine vs PD cluster vs fused cluster")
    ap.add_argument(
        "--model", default=None, help="model dir or preset name for --compare (smollm2-135m)"
    )
    ap.add_argument("--model-preset", default="llama-100m", help="used when --model is not given")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--shared-prefix", type=float, default=0.0, help="fraction of each prompt shared"
    )
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson rate (req/s)")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--kv-cache-mib", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.compare:
        results = compare(args)
        print(json.dumps(results, indent=2))
        base = results["engine"]
        print(
            f"\n{'target':8} {'out tok/s':>10} {'vs engine':>9} {'TTFT p50 ms':>12} {'+ms vs engine':>13} {'TPOT p50 ms':>12}"
        )
        for name, r in results.items():
            print(
                f"{name:8} {r['output_throughput']:10.1f} {r['output_throughput'] / base['output_throughput']:9.2f} "
                f"{r['ttft_ms']['p50']:12.1f} {r['ttft_ms']['p50'] - base['ttft_ms']['p50']:13.1f} {r['tpot_ms']['p50']:12.1f}"
            )
    elif args.url:
        prompts = make_prompts(
            args.num_requests, args.input_len, args.shared_prefix, args.vocab, args.seed
        )
        print(json.dumps(asyncio.run(bench_url(args.url.rstrip("/"), prompts, args)), indent=2))
    else:
        ap.error("give --url or --compare")


if __name__ == "__main__":
    main()
