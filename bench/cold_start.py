"""Scale-to-zero cold start: from a request's arrival at a cluster with no worker to its
first token, on this machine with a real worker.

    python bench/cold_start.py [--model smollm2-135m] [--runs 3] [--threads 2]

Runs `rtp-serve up --planner --fused 1 --min-workers 0` (the whole cluster, real processes),
waits until the planner has no worker running, sends one streamed request, and times its
first token; then waits for the worker to be stopped again (--idle-to-zero-s) and repeats.
Each run says, from the request's arrival, when the planner had started a worker (it notices
at its next interval), when the frontend knew the worker (registered: model loaded), and
when the first token came. Prints the CPU flags.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import httpx  # noqa: E402

from rtp_serve.kernels.isa import bench_flags  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402
from rtp_serve.services.launcher.process import launch  # noqa: E402

PROMPT = "Write a haiku about autumn."


def plan(url: str) -> dict:
    with urllib.request.urlopen(url + "/plan", timeout=5) as reply:
        return json.loads(reply.read())


def running(url: str) -> int:
    return plan(url).get("current", {}).get("fused", 0)


def frontend_workers(url: str) -> int:
    with urllib.request.urlopen(url + "/ready", timeout=5) as reply:
        return json.loads(reply.read()).get("workers", 0)


def one_run(frontend: str, planner: str, model_id: str) -> dict:
    """One request at zero workers; when the planner started a worker, when the frontend
    knew it (registered), and when the first token came, from the request's arrival."""
    marks: dict[str, float] = {}
    done = threading.Event()
    sent = time.monotonic()

    def watch() -> None:
        while not done.is_set():
            now = time.monotonic() - sent
            with contextlib.suppress(OSError, ValueError):  # a slow answer: ask again
                if "started" not in marks and running(planner) > 0:
                    marks["started"] = now
                if "registered" not in marks and frontend_workers(frontend) > 0:
                    marks["registered"] = now
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 8, "stream": True}
    with (
        httpx.Client(base_url=frontend, timeout=120) as http,
        http.stream("POST", "/v1/completions", json=body) as reply,
    ):
        reply.raise_for_status()
        for line in reply.iter_lines():
            if "first" not in marks and line.startswith("data: {"):
                marks["first"] = time.monotonic() - sent
    done.set()
    watcher.join()
    return marks


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="worker threads (0: every core)")
    ap.add_argument("--interval-s", type=float, default=1.0, help="the planner's interval")
    ap.add_argument("--idle-to-zero-s", type=float, default=5.0)
    args = ap.parse_args(argv)
    model = resolve_model(args.model)
    threads = str(args.threads or os.cpu_count() or 1)
    flags = ("--planner", "--fused", "1", "--min-workers", "0", "--max-workers", "1",
             "--threads", threads, "--planner-interval-s", str(args.interval_s),
             "--idle-to-zero-s", str(args.idle_to_zero_s), "--down-cooldown-s", "1",
             "--hold-for-workers-s", "120", "--no-cache")  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as tmp, launch(str(model), Path(tmp), *flags) as c:
        planner = c.info["planner"]
        model_id = httpx.get(c.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for _ in range(args.runs):
            deadline = time.monotonic() + 120
            while running(planner) > 0:
                if time.monotonic() > deadline:
                    raise TimeoutError("the planner did not scale to zero")
                time.sleep(0.2)
            time.sleep(1.0)  # the stopped worker is gone, not only stopping
            results.append(one_run(c.url, planner, model_id))
    firsts = [r["first"] for r in results]
    print(f"# {bench_flags()}; load average {os.getloadavg()[0]:.1f}; model {model.name}; "
          f"worker threads {threads}; planner interval {args.interval_s:.1f} s")  # fmt: skip
    print("| run | planner started a worker (s) | worker registered (s) | first token (s) |")
    print("|---|---|---|---|")
    for i, r in enumerate(results):
        cells = " | ".join(
            f"{r[k]:.2f}" if k in r else "-" for k in ("started", "registered", "first")
        )
        print(f"| {i + 1} | {cells} |")
    print(f"| median | | | {statistics.median(firsts):.2f} |")
    return results


if __name__ == "__main__":
    main()
