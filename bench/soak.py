"""Soak: hold a launched cluster at saturation for a long time with mixed traffic, and check
that nothing leaks or drifts.

    python bench/soak.py                          # 10 minutes, fused:2, tiny-llama
    python bench/soak.py --topology pd:1:1 --duration-s 600 --clients 32
    python bench/soak.py --test-size              # 1 minute (what tests/test_soak.py runs)

`--clients` loops send requests back to back (more than the workers run at once, so queues
never drain): streamed and whole completions and chats of mixed prompt and output lengths,
some with n=2 or stop strings, some cancelled by the client (a deadline on its side) and
some disconnected mid-stream. Every `--sample-s` the resident memory (VmRSS) of every
process of the cluster is read. At the end: requests by outcome, TTFT p50/p99 per window
(a minute by default), each process's memory per window (its mean resident size there), and
the blocks the workers still hold once traffic stopped.

Targets (the exit status says whether they were met): 0 failed requests, 0 leaked blocks,
every process's memory in the last window at most 5% above its level in the second (the
first is warm-up; less is fine: that is no leak), and TTFT p99 in the last window within 1.2x of the second window's. The
cluster's cache tiers are made small (4 MiB cache service, 8 MiB Redis) so that they fill
during warm-up, like everything else that is sized once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent  # run as a script: the repository root first
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from bench.chaos import View, topology_flags  # noqa: E402
from rtp_serve.kernels.isa import cpu_isa  # noqa: E402
from rtp_serve.services.launcher.process import launch  # noqa: E402

WORDS = [
    "the",
    "of",
    "and",
    "a",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
]
KINDS = ("stream", "stream", "whole", "chat", "cancel", "disconnect")  # drawn uniformly
MEMORY_SLACK = 0.05
TTFT_SLACK = 1.2


@dataclass(slots=True)
class Outcome:
    started: float  # seconds since the soak began
    kind: str
    ok: bool
    ttft: float | None = None  # streamed requests that got a first chunk
    error: str = ""


@dataclass
class Soak:
    outcomes: list[Outcome] = field(default_factory=list)
    memory: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # name -> samples


# -- traffic ------------------------------------------------------------------------------------
class Client:
    def __init__(self, url: str, model_id: str, seed: int, start: float) -> None:
        self.url, self.model_id, self.start = url, model_id, start
        self.rng = random.Random(seed)

    def _body(self, kind: str) -> tuple[str, dict]:
        rng = self.rng
        words = " ".join(rng.choice(WORDS) for _ in range(rng.choice((3, 12, 40, 120))))
        body: dict = {"model": self.model_id, "max_tokens": rng.choice((4, 16, 32, 48)),
                      "temperature": rng.choice((0.0, 0.8)), "seed": rng.randrange(1 << 30)}  # fmt: skip
        if rng.random() < 0.15:
            body["n"] = 2
        if rng.random() < 0.15:
            body["stop"] = [rng.choice(WORDS)]
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": words}]
            return "/v1/chat/completions", body | {"stream": True}
        body["prompt"] = words
        return "/v1/completions", body | {"stream": kind != "whole"}

    async def run(self, http: aiohttp.ClientSession, soak: Soak, until: float) -> None:
        while time.monotonic() < until:
            kind = self.rng.choice(KINDS)
            path, body = self._body(kind)
            outcome = Outcome(time.monotonic() - self.start, kind, ok=False)
            try:
                if kind == "cancel":  # the client gives up after a short while
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._send(http, path, body, outcome), 0.2)
                else:
                    stop_after = 2 if kind == "disconnect" else None
                    await self._send(http, path, body, outcome, stop_after)
                outcome.ok = True
            except Exception as exc:
                outcome.error = f"{type(exc).__name__}: {exc}"[:200]
                await asyncio.sleep(0.05)
            soak.outcomes.append(outcome)

    async def _send(
        self,
        http: aiohttp.ClientSession,
        path: str,
        body: dict,
        outcome: Outcome,
        stop_after: int | None = None,
    ) -> None:
        sent = time.monotonic()
        async with http.post(self.url + path, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:120]}")
            if not body.get("stream"):
                json.loads(await r.text())
                return
            chunks = 0
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if "error" in json.loads(line[6:]):
                    raise RuntimeError(f"error chunk: {line[:120]}")
                if outcome.ttft is None:
                    outcome.ttft = time.monotonic() - sent
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    r.close()  # the client disconnects mid-stream
                    return


# -- memory ----------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def sample_memory(view: View, soak: Soak, start: float, every: float, until: float) -> None:
    while time.monotonic() < until:
        now = time.monotonic() - start
        for i, p in enumerate(view.info()["pids"]):
            rss = rss_bytes(p["pid"])
            if rss is not None:
                soak.memory.setdefault(f"{p['name']}[{i}]", []).append((now, rss))
        await asyncio.sleep(every)


# -- the run --------------------------------------------------------------------------------------
async def _soak(view: View, model_id: str, args: argparse.Namespace) -> tuple[Soak, int]:
    soak = Soak()
    start = time.monotonic()
    until = start + args.duration_s
    timeout = aiohttp.ClientTimeout(total=300, sock_connect=5)
    connector = aiohttp.TCPConnector(limit=args.clients * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        clients = [Client(view.url, model_id, args.seed + i, start) for i in range(args.clients)]
        await asyncio.gather(
            sample_memory(view, soak, start, args.sample_s, until),
            *(c.run(http, soak, until) for c in clients),
        )
    return soak, await view.held_blocks(timeout=30.0)


def run(args: argparse.Namespace) -> dict:
    from rtp_serve.models.make_model import resolve_model

    model = str(resolve_model(args.model))
    # Small cache tiers fill during warm-up: after it, their memory must stay flat too.
    flags = ["--kv-cache-mib", str(args.kv_cache_mib),
             "--cache-capacity-mib", "4", "--redis-maxmemory-mib", "8",
             *topology_flags(args.topology), *args.launcher_args.split()]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, launch(model, Path(tmp), *flags) as c:
        view = View(c.url, Path(tmp) / "cluster.json", ttl=3.0)  # the launcher's default
        soak, leaked = asyncio.run(_soak(view, Path(model).name, args))
    return summarize(soak, leaked, args.window_s)


def summarize(soak: Soak, leaked: int, window_s: float) -> dict:
    """The report: outcomes, TTFT per window, memory growth per process, leaked blocks."""
    failed = [o for o in soak.outcomes if not o.ok]
    windows = []
    last = max((o.started for o in soak.outcomes), default=0.0)
    for w in range(int(last // window_s) + 1):
        ttfts = [o.ttft for o in soak.outcomes
                 if o.ttft is not None and w * window_s <= o.started < (w + 1) * window_s]  # fmt: skip
        if ttfts:
            windows.append({"window": w + 1, "requests": len(ttfts),
                            "ttft_p50_ms": float(np.percentile(ttfts, 50) * 1000),
                            "ttft_p99_ms": float(np.percentile(ttfts, 99) * 1000)})  # fmt: skip
    memory = {}
    for name, samples in soak.memory.items():
        # A process's level in a window is its mean there: one sample of a process with a
        # garbage collector (NATS) may fall on a peak or a trough of its cycle.
        curve = []
        for w in range(int(samples[-1][0] // window_s) + 1 if samples else 0):
            level = [rss for t, rss in samples if w * window_s <= t < (w + 1) * window_s]
            if level:
                curve.append(float(np.mean(level)))
        if len(curve) >= 2:  # the first window is warm-up
            memory[name] = {"curve": curve, "after_warmup": curve[1], "end": curve[-1],
                            "growth": curve[-1] / curve[1] - 1}  # fmt: skip
    ttft_ratio = None
    if len(windows) >= 3:  # the second window against the last (the first is warm-up)
        ttft_ratio = windows[-1]["ttft_p99_ms"] / windows[1]["ttft_p99_ms"]
    return {
        "requests": len(soak.outcomes),
        "by_kind": {k: sum(o.kind == k for o in soak.outcomes) for k in sorted(set(KINDS))},
        "failed": len(failed),
        "errors": sorted({o.error for o in failed})[:5],
        "leaked_blocks": leaked,
        "windows": windows,
        "memory": memory,
        "ttft_p99_last_over_second": ttft_ratio,
    }


def targets(report: dict) -> dict[str, bool]:
    ratio = report["ttft_p99_last_over_second"]
    return {
        "0 failed requests": report["failed"] == 0,
        "0 leaked blocks": report["leaked_blocks"] == 0,
        f"memory at most {MEMORY_SLACK:.0%} above warm-up": all(
            m["growth"] <= MEMORY_SLACK for m in report["memory"].values()
        ),
        f"TTFT p99 last window <= {TTFT_SLACK}x second": ratio is not None and ratio <= TTFT_SLACK,
    }


def render(report: dict, args: argparse.Namespace) -> str:
    kinds = ", ".join(f"{n} {k}" for k, n in report["by_kind"].items())
    lines = [
        f"cpu: {cpu_isa().describe()}",
        f"soak: {args.topology}, {args.duration_s:g} s, {args.clients} clients, model "
        f"{args.model}: {report['requests']} requests ({kinds}), {report['failed']} failed, "
        f"{report['leaked_blocks']} blocks leaked",
        f"{'window':>6} {'requests':>8} {'ttft p50':>10} {'ttft p99':>10}",
    ]
    lines += [f"{w['window']:>6} {w['requests']:>8} {w['ttft_p50_ms']:>8.0f}ms "
              f"{w['ttft_p99_ms']:>8.0f}ms" for w in report["windows"]]  # fmt: skip
    lines.append(f"{'process':<16} {'rss warm':>10} {'rss end':>10} {'growth':>7}  "
                 "mean rss per window, MiB")  # fmt: skip
    for name, m in sorted(report["memory"].items()):
        curve = " ".join(f"{level / 2**20:.1f}" for level in m["curve"])
        lines.append(f"{name:<16} {m['after_warmup'] / 2**20:>8.1f}Mi "
                     f"{m['end'] / 2**20:>8.1f}Mi {m['growth']:>+7.1%}  {curve}")  # fmt: skip
    lines += [f"  {'met ' if ok else 'MISSED'} {name}" for name, ok in targets(report).items()]
    lines += [f"  error: {e}" for e in report["errors"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--topology", default="fused:2", help="pd:P:D or fused:K")
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--window-s", type=float, default=60.0, help="TTFT percentiles per window")
    p.add_argument("--sample-s", type=float, default=5.0, help="memory sampling period")
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--kv-cache-mib", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--launcher-args", default="", help="more flags for rtp-serve up")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--test-size", action="store_true", help="1 minute in 15 s windows")
    args = p.parse_args(argv)
    if args.test_size:
        args.duration_s, args.window_s, args.sample_s, args.clients = 60.0, 15.0, 2.0, 12
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(render(report, args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(targets(report).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
