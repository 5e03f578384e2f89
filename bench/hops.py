"""TTFT by hop: where a request's time to first token goes inside a cluster, from the
frontend's histograms (services/frontend/metrics.py), scraped before and after a run.

    client TTFT = HTTP and client     (the bench's TTFT - the frontend's)
                + admit and route     (rtp:request_queue_time_seconds: arrival at the frontend
                                       to the worker stream opening: tokenize, limits, route)
                + worker queue        (rtp:ttft_worker_queue_seconds: arrival at the worker's
                                       engine to its first scheduled step)
                + worker prefill      (rtp:ttft_worker_prefill_seconds: that step to the first
                                       token leaving the engine)
                + transit             (the rest of the frontend's TTFT: the request reaching
                                       the engine, the token reaching the frontend: gRPC,
                                       asyncio loops, the engine thread's hand-offs)

Means over the run's requests, in milliseconds. A server without these families (vLLM, the
in-process engine) has no split.
"""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

FAMILIES = {
    "frontend": "rtp:time_to_first_token_seconds",
    "admit and route": "rtp:request_queue_time_seconds",
    "worker queue": "rtp:ttft_worker_queue_seconds",
    "worker prefill": "rtp:ttft_worker_prefill_seconds",
}
Sums = dict[str, tuple[float, float]]  # hop -> (sum of seconds, count)


async def scrape(url: str) -> Sums | None:
    """The histograms' sums and counts at `url`/metrics, or None where it has none."""
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{url}/metrics") as reply,
        ):
            if reply.status != 200:
                return None
            text = await reply.text()
    except aiohttp.ClientError:
        return None
    wanted = {
        f"{name}_{part}": (hop, part) for hop, name in FAMILIES.items() for part in ("sum", "count")
    }
    got: dict[str, list[float]] = {hop: [0.0, 0.0] for hop in FAMILIES}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                hop, part = wanted[sample.name]
                got[hop][part == "count"] += sample.value
    if not got["frontend"][1]:
        return None
    return {hop: (s, c) for hop, (s, c) in got.items()}


def split(before: Sums, after: Sums, client_ttft_ms: float) -> dict[str, float]:
    """Mean milliseconds per hop over the requests between the two scrapes."""

    def mean(hop: str) -> float:
        s = after[hop][0] - before[hop][0]
        c = after[hop][1] - before[hop][1]
        return 1e3 * s / c if c else 0.0

    frontend = mean("frontend")
    hops = {
        "client TTFT": client_ttft_ms,
        "HTTP and client": client_ttft_ms - frontend,
        "admit and route": mean("admit and route"),
        "worker queue": mean("worker queue"),
        "worker prefill": mean("worker prefill"),
    }
    hops["transit"] = (
        frontend - hops["admit and route"] - hops["worker queue"] - hops["worker prefill"]
    )
    return hops


def describe(hops: dict[str, float]) -> str:
    total = hops["client TTFT"]
    parts = ", ".join(
        f"{hop} {ms:.1f} ({100 * ms / total:.0f}%)"
        for hop, ms in hops.items()
        if hop != "client TTFT"
    )
    return f"TTFT {total:.1f} ms = {parts}"
