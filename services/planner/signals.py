"""What the planner sees of the cluster: members, load reports, and the frontends' metrics.

    nameservice watch ----> members by role (workers, frontends and their /metrics)
    NATS load.*       ----> each worker's latest LoadReport (its fitted step cost, queue)
    GET frontend /metrics -> cumulative counters and histograms; two scrapes make a Window:
                             arrivals/s, mean prompt and output tokens, TTFT and ITL p95,
                             requests waiting for a worker (scale from zero)

Counters that went down belong to a restarted frontend: its window counts from zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from rtp_serve.core.cost_model import StepCost
from rtp_serve.services.common.naming import MemberSet, NameClient
from rtp_serve.services.common.pb import events_pb2
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2

log = logging.getLogger(__name__)

ROLE_NAMES = {
    ns_pb2.ROLE_FUSED: "fused",
    ns_pb2.ROLE_PREFILL: "prefill",
    ns_pb2.ROLE_DECODE: "decode",
}
SCRAPE_TIMEOUT_S = 2.0
REPORT_TTL_S = 5.0  # a LoadReport older than this describes no running worker

# The frontend's families (services/frontend/metrics.py), as exposed.
ARRIVED = "rtp:requests_received"
WAITING = "rtp:requests_waiting_for_workers"
FINISHED = "rtp:request_success"
PROMPT = "rtp:prompt_tokens"
PROMPT_ARRIVED = "rtp:prompt_tokens_received"
OUTPUT = "rtp:generation_tokens"
TTFT = "rtp:time_to_first_token_seconds"
ITL = "rtp:inter_token_latency_seconds"


@dataclass(slots=True)
class Scrape:
    """One frontend's cumulative numbers at one moment (summed over served models)."""

    counters: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # le -> count
    waiting: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Scrape:
        """By sample name: the parser names a counter's family with or without `_total`
        depending on how its TYPE line spells it."""
        scrape = cls()
        names = (ARRIVED, PROMPT_ARRIVED, FINISHED, PROMPT, OUTPUT)
        counters = {name + "_total": name for name in names}
        buckets = {name + "_bucket": name for name in (TTFT, ITL)}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in counters:
                    name = counters[sample.name]
                    scrape.counters[name] = scrape.counters.get(name, 0.0) + sample.value
                elif sample.name == WAITING:
                    scrape.waiting += sample.value
                elif sample.name in buckets:
                    le = float(sample.labels["le"])
                    hist = scrape.buckets.setdefault(buckets[sample.name], {})
                    hist[le] = hist.get(le, 0.0) + sample.value
        return scrape

    def minus(self, before: Scrape | None) -> Scrape:
        """The increase since `before` (None, or a restarted frontend's: all of it)."""
        if before is None or any(self.counters.get(k, 0.0) < v for k, v in before.counters.items()):
            return Scrape(
                dict(self.counters), {k: dict(v) for k, v in self.buckets.items()}, self.waiting
            )
        counters = {k: v - before.counters.get(k, 0.0) for k, v in self.counters.items()}
        buckets = {
            name: {le: n - before.buckets.get(name, {}).get(le, 0.0) for le, n in hist.items()}
            for name, hist in self.buckets.items()
        }
        return Scrape(counters, buckets, self.waiting)


def quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus's histogram_quantile over cumulative buckets (le -> count): linear within
    the bucket the rank falls in; nan without observations."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return math.nan
    total = buckets[edges[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in edges:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower  # beyond the last finite bucket: its bound is all we know
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, count
    return lower


@dataclass(frozen=True, slots=True)
class Window:
    """The cluster over the last interval, as the frontends measured it."""

    seconds: float
    arrivals: float  # sequences that arrived
    finished: float
    arrived_prompt_tokens: float  # of the sequences that arrived
    prompt_tokens: float  # of the finished ones
    output_tokens: float
    ttft_p95_s: float  # nan: no first token in the window
    itl_p95_s: float
    ttft_count: float
    waiting_for_workers: float  # requests held at the frontends now (none routable)

    @property
    def rate(self) -> float:
        return self.arrivals / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def of(cls, seconds: float, deltas: Iterable[Scrape]) -> Window:
        total = Scrape()
        for d in deltas:
            for k, v in d.counters.items():
                total.counters[k] = total.counters.get(k, 0.0) + v
            for name, hist in d.buckets.items():
                into = total.buckets.setdefault(name, {})
                for le, n in hist.items():
                    into[le] = into.get(le, 0.0) + n
            total.waiting += d.waiting
        ttft = total.buckets.get(TTFT, {})
        return cls(
            seconds=seconds,
            arrivals=total.counters.get(ARRIVED, 0.0),
            arrived_prompt_tokens=total.counters.get(PROMPT_ARRIVED, 0.0),
            finished=total.counters.get(FINISHED, 0.0),
            prompt_tokens=total.counters.get(PROMPT, 0.0),
            output_tokens=total.counters.get(OUTPUT, 0.0),
            ttft_p95_s=quantile(ttft, 0.95),
            itl_p95_s=quantile(total.buckets.get(ITL, {}), 0.95),
            ttft_count=max(ttft.values(), default=0.0),
            waiting_for_workers=total.waiting,
        )


@dataclass(slots=True)
class Report:
    role: str
    load: events_pb2.LoadReport
    at: float  # monotonic receive time


class Observer:
    """Follows the nameservice and the load reports; scrapes the frontends on demand."""

    def __init__(self, names: NameClient | None, metrics_key: str | None = None) -> None:
        self.members = MemberSet()
        self._names = names
        self._headers = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else {}
        self._reports: dict[str, Report] = {}
        self._last: dict[str, Scrape] = {}
        self._last_at: float | None = None
        self._session: aiohttp.ClientSession | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S))
        if self._names is not None:
            self._watch = asyncio.create_task(self._follow(), name="planner-membership")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._session is not None:
            await self._session.close()

    async def on_load(self, report: events_pb2.LoadReport, headers: object = None) -> None:
        member = self.members.members.get(report.worker_id)
        role = ROLE_NAMES.get(member.role) if member is not None else None
        if role is not None:
            self._reports[report.worker_id] = Report(role, report, time.monotonic())

    def workers(self) -> dict[str, list[str]]:
        """Role -> registered worker ids."""
        out: dict[str, list[str]] = {name: [] for name in ROLE_NAMES.values()}
        for member in self.members.members.values():
            role = ROLE_NAMES.get(member.role)
            if role is not None:
                out[role].append(member.id)
        return out

    def fresh_reports(self, role: str) -> list[events_pb2.LoadReport]:
        now = time.monotonic()
        alive = self.members.members
        return [
            r.load
            for wid, r in self._reports.items()
            if r.role == role and wid in alive and now - r.at <= REPORT_TTL_S
        ]

    def step_cost(self, role: str) -> StepCost | None:
        """The median fitted step cost of `role`'s workers (None: none has fitted one)."""
        fitted = [r for r in self.fresh_reports(role) if r.step_fixed_s > 0 or r.step_token_s > 0]
        if not fitted:
            return None
        return StepCost(
            fixed_s=statistics.median(r.step_fixed_s for r in fitted),
            token_s=statistics.median(r.step_token_s for r in fitted),
            row_s=statistics.median(r.step_row_s for r in fitted),
            token_budget=int(statistics.median(r.step_token_budget for r in fitted)),
        )

    def least_loaded(self, role: str) -> list[str]:
        """`role`'s worker ids, least loaded first (those without a report first: nothing
        known runs there, or it is still starting)."""
        loads = {r.worker_id: r.num_running + r.num_waiting for r in self.fresh_reports(role)}
        ids = self.workers()[role]
        return sorted(ids, key=lambda wid: (loads.get(wid, -1), wid))

    async def window(self) -> Window | None:
        """The interval since the last call (None on the first: no interval yet)."""
        now = time.monotonic()
        frontends = [m for m in self.members.members.values() if m.role == ns_pb2.ROLE_FRONTEND]
        scrapes = await asyncio.gather(*(self._scrape(m.metrics_address) for m in frontends))
        deltas = []
        current: dict[str, Scrape] = {}
        for member, scrape in zip(frontends, scrapes, strict=True):
            if scrape is None:
                continue
            current[member.id] = scrape
            deltas.append(scrape.minus(self._last.get(member.id)))
        first = self._last_at is None
        # A frontend that failed one scrape keeps its last numbers: its next delta spans both.
        self._last = {
            **{k: v for k, v in self._last.items() if k in self.members.members},
            **current,
        }
        seconds = now - self._last_at if self._last_at is not None else 0.0
        self._last_at = now
        return None if first else Window.of(seconds, deltas)

    async def _scrape(self, address: str) -> Scrape | None:
        if not address or self._session is None:
            return None
        try:
            async with self._session.get(
                f"http://{address}/metrics", headers=self._headers
            ) as reply:
                if reply.status != 200:
                    log.warning("frontend %s /metrics: HTTP %d", address, reply.status)
                    return None
                return Scrape.parse(await reply.text())
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("frontend %s /metrics unreachable: %r", address, e)
            return None

    async def _follow(self) -> None:
        assert self._names is not None
        while True:
            try:
                async for event in self._names.watch():
                    self.members.apply(event)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("membership watch failed; restarting it")
            await asyncio.sleep(1.0)
