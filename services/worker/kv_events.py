"""A worker's cluster events: the engine's prefix-cache changes (rtp.v1.KVEvents) and its
load (rtp.v1.LoadReport), published on NATS at a bounded rate; and the snapshot
(rtp.v1.KVSnapshot) the master resyncs its index from.

The numbering, netting and snapshot protocol are services/common/kv_feed.py's; the engine
is the worker's own: its device pool is the upper tier, its host tier the lower one, and a
snapshot takes the pending events and the cached hashes in one engine call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rtp_serve.engine.block_pool import KVEvent, KVEventKind, KVTier
from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.kv_feed import EVENT_INTERVAL_S, Changes, Held, KVFeed
from rtp_serve.services.common.pb import events_pb2
from rtp_serve.services.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from rtp_serve.engine.async_llm import AsyncLLM

__all__ = ["EVENT_INTERVAL_S", "KVEventFeed", "load_report", "publish_events"]

log = logging.getLogger(__name__)

# A load report goes out at most this often, when something in it changed since the last;
# an unchanged one at least every LOAD_KEEPALIVE_S. The master counts a report for 1 s
# (services/master/cluster.py: LOAD_TTL_S), so one keepalive lost or late by 150 ms leaves
# the worker known. At 1,000 idle workers, reports unchanged but for their stamp were most
# of the master's idle CPU (docs/operations/scale.md: quiet load reports).
LOAD_INTERVAL_S = 0.25
LOAD_KEEPALIVE_S = 0.4
_EARLY_S = 0.002  # a sleep may end this much before its time, by the loop's clock


def _changes(events: Sequence[KVEvent]) -> Changes:
    changes = Changes()
    for event in events:
        tier = changes.upper if event.tier == KVTier.DEVICE else changes.lower
        tier.append((event.block_hash, event.kind == KVEventKind.STORED))
    return changes


class KVEventFeed(KVFeed):
    """Numbers and publishes one worker's KV event batches; serves consistent snapshots."""

    def __init__(
        self,
        llm: AsyncLLM,
        bus: Bus,
        worker_id: str,
        namespace: str = subjects.DEFAULT_NAMESPACE,
        incarnation: int | None = None,
    ) -> None:
        super().__init__(bus, worker_id, namespace, incarnation)
        self.llm = llm

    @property
    def worker_id(self) -> str:
        return self.member_id

    async def _take(self) -> Changes:
        return _changes(await self.llm.take_kv_events())

    def _pending(self) -> bool:
        return self.llm.kv_events_pending()

    async def _held(self) -> Held:
        events, (device, host) = await self.llm.kv_snapshot()
        return Held(_changes(events), device, host)


def load_report(llm: AsyncLLM, feed: KVEventFeed, remote_tier: bool) -> events_pb2.LoadReport:
    """The worker's load now, with its fitted cost model (what the master predicts with)."""
    s, cost = llm.stats(), llm.step_cost()
    return events_pb2.LoadReport(
        worker_id=feed.worker_id,
        num_waiting=s.num_waiting,
        num_running=s.num_running,
        free_blocks=s.num_free_blocks,
        total_blocks=s.num_total_blocks,
        queued_tokens=s.num_queued_tokens,
        block_size=llm.block_size,
        unix_ms=int(time.time() * 1000),
        queue_wait_s=cost.queue_wait_s(s.num_queued_tokens, s.num_running),
        prefill_tokens_per_s=cost.prefill_tokens_per_s,
        decode_step_s=cost.decode_step_s(s.num_running),
        max_num_waiting=llm.max_num_waiting,
        max_num_seqs=llm.max_num_seqs,
        incarnation=feed.incarnation,
        kv_seq=feed.seq,
        step_fixed_s=cost.fixed_s,
        step_token_s=cost.token_s,
        step_row_s=cost.row_s,
        step_token_budget=cost.token_budget,
        fetch_costs=[
            events_pb2.TierFetchCost(tier=tier, fixed_s=c.fixed_s, byte_s=c.byte_s)
            for tier, c in llm.costs.fetch().items()
        ],
        kv_block_bytes=llm.kv_block_bytes,
        remote_tier=remote_tier,
        loras=s.loras.known if s.loras else (),
        resident_loras=s.loras.resident if s.loras else (),
    )


async def publish_events(
    feed: KVEventFeed,
    namespace: str,
    load_metrics: WorkerMetrics | None = None,
    remote_tier: bool = False,
) -> None:
    """Forward the engine's stored/removed block events and load until cancelled; the load
    also goes to `load_metrics` (the Prometheus gauges).

    The events go as the engine tells of them (AsyncLLM.watch_kv_events: with a step's
    outputs, at most every EVENT_INTERVAL_S), the load every LOAD_INTERVAL_S. An idle worker
    wakes only for its load: 4 times a second, not 20 for a look at events that never came.
    """
    feed.llm.watch_kv_events(feed.notify)
    events = asyncio.create_task(feed.run(), name="kv events")
    try:
        await _publish_load(feed, namespace, load_metrics, remote_tier)
    finally:
        events.cancel()
        await asyncio.gather(events, return_exceptions=True)


async def _publish_load(
    feed: KVEventFeed, namespace: str, load_metrics: WorkerMetrics | None, remote_tier: bool
) -> None:
    llm, bus = feed.llm, feed.bus
    keepalive_at = 0.0  # when an unchanged report goes out again
    last_said = b""  # the last report published, less its stamp
    load_subject = subjects.load_report(feed.worker_id, namespace)
    while True:
        await asyncio.sleep(max(0.0, min(LOAD_INTERVAL_S, keepalive_at - time.monotonic())))
        # Under the feed's batch numbering: the report names the latest batch published,
        # and goes after it on the same connection (NATS keeps the order).
        async with feed.numbering():
            report = load_report(llm, feed, remote_tier)
            if load_metrics is not None:
                load_metrics.load(
                    report.num_running, report.num_waiting, report.free_blocks,
                    report.total_blocks,
                )  # fmt: skip
                load_metrics.wait(report.queue_wait_s, report.prefill_tokens_per_s)
                stats = llm.stats()
                load_metrics.host_tier(stats.host_tier)
                load_metrics.spec_decode(stats.spec)
                load_metrics.lora(stats.loras)
            said = _said(report)
            now = time.monotonic()
            if said == last_said and now < keepalive_at - _EARLY_S:
                continue
            last_said, keepalive_at = said, now + LOAD_KEEPALIVE_S
            await bus.publish(load_subject, report)


def _said(report: events_pb2.LoadReport) -> bytes:
    """What a report says, its stamp aside: two reports that differ only in when they were
    made are the same load."""
    stamp, report.unix_ms = report.unix_ms, 0
    try:
        return report.SerializeToString(deterministic=True)
    finally:
        report.unix_ms = stamp
