"""A worker's cluster events: the engine's prefix-cache changes (rtp.v1.KVEvents) and its
load (rtp.v1.LoadReport), published on NATS at a bounded rate; and the snapshot
(rtp.v1.KVSnapshot) the master resyncs its index from.

Batches are numbered 1, 2, 3, ... within one incarnation (the process's start time), and a
number is spent even when NATS drops the batch: that hole is how the master learns it
missed something. A snapshot drains the engine's pending events into the next batch in the
same engine call that lists the cache, under the lock that orders batches, so

    snapshot(seq=S) == apply(batch 1..S)        and batches > S hold only later changes

which is all the master needs to replace its entries and then replay what comes after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from rtp_serve.engine.async_llm import AsyncLLM
from rtp_serve.engine.block_pool import KVEvent, KVEventKind, KVTier
from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import events_pb2, worker_pb2
from rtp_serve.services.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

EVENT_INTERVAL_S = 0.05  # KV events: at most 20 messages a second
LOAD_INTERVAL_S = 0.25  # the master ignores reports older than a few of these


class KVEventFeed:
    """Numbers and publishes one worker's KV event batches; serves consistent snapshots."""

    def __init__(
        self,
        llm: AsyncLLM,
        bus: Bus,
        worker_id: str,
        namespace: str = subjects.DEFAULT_NAMESPACE,
        incarnation: int | None = None,
    ) -> None:
        self.llm = llm
        self.bus = bus
        self.worker_id = worker_id
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.seq = 0  # the last batch numbered (published or dropped)
        self._subject = subjects.kv_events(worker_id, namespace)
        self._lock = asyncio.Lock()  # one batch numbered at a time

    async def flush(self) -> None:
        """Publish the engine's pending events as the next batch (none pending: nothing)."""
        async with self._lock:
            await self._publish(await self.llm.take_kv_events())

    async def snapshot(self) -> worker_pb2.KVSnapshot:
        """Every hash held now, and the batch number it is consistent with."""
        async with self._lock:
            events, (device, host) = await self.llm.kv_snapshot()
            await self._publish(events)  # its batch number is the snapshot's: covered
            return worker_pb2.KVSnapshot(
                worker_id=self.worker_id,
                incarnation=self.incarnation,
                seq=self.seq,
                block_hashes=device,
                host_block_hashes=host,
            )

    async def _publish(self, events: Sequence[KVEvent]) -> None:
        if not events:
            return
        # Net the batch: only each hash's last event in each tier counts (stored then
        # evicted = gone).
        last = {(event.tier, event.block_hash): event.kind for event in events}

        def hashes(tier: KVTier, kind: KVEventKind) -> list[bytes]:
            return [h for (t, h), k in last.items() if t == tier and k == kind]

        self.seq += 1
        msg = events_pb2.KVEvents(
            worker_id=self.worker_id,
            seq=self.seq,
            incarnation=self.incarnation,
            stored=hashes(KVTier.DEVICE, KVEventKind.STORED),
            removed=hashes(KVTier.DEVICE, KVEventKind.REMOVED),
            host_stored=hashes(KVTier.HOST, KVEventKind.STORED),
            host_removed=hashes(KVTier.HOST, KVEventKind.REMOVED),
        )
        await self.bus.publish(self._subject, msg)


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
    also goes to `load_metrics` (the Prometheus gauges)."""
    llm, bus = feed.llm, feed.bus
    last_load = 0.0
    load_subject = subjects.load_report(feed.worker_id, namespace)
    while True:
        await asyncio.sleep(EVENT_INTERVAL_S)
        await feed.flush()
        now = time.monotonic()
        if now - last_load >= LOAD_INTERVAL_S:
            last_load = now
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
            # Published after the batch it names, on the same connection: NATS keeps the order.
            await bus.publish(load_subject, report)
