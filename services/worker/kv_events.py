"""A worker's cluster events: the engine's prefix-cache changes (rtp.v1.KVEvents) and its
load (rtp.v1.LoadReport), published on NATS at a bounded rate."""

from __future__ import annotations

import asyncio
import time

from engine.async_llm import AsyncLLM
from engine.block_pool import KVEventKind
from services.common import subjects
from services.common.bus import Bus
from services.common.pb import events_pb2
from services.worker.metrics import WorkerMetrics

EVENT_INTERVAL_S = 0.05  # KV events: at most 20 messages a second
LOAD_INTERVAL_S = 0.25


async def publish_events(
    llm: AsyncLLM,
    bus: Bus,
    worker_id: str,
    namespace: str,
    load_metrics: WorkerMetrics | None = None,
) -> None:
    """Forward the engine's stored/removed block events and load until cancelled; the load
    also goes to `load_metrics` (the Prometheus gauges)."""
    seq = 0
    last_load = 0.0
    kv_subject = subjects.kv_events(worker_id, namespace)
    load_subject = subjects.load_report(worker_id, namespace)
    while True:
        await asyncio.sleep(EVENT_INTERVAL_S)
        events = await llm.take_kv_events()
        if events:
            # Net the batch: only each hash's last event counts (stored then evicted = gone).
            last = {event.block_hash: event.kind for event in events}
            seq += 1
            msg = events_pb2.KVEvents(
                worker_id=worker_id,
                seq=seq,
                stored=[h for h, kind in last.items() if kind == KVEventKind.STORED],
                removed=[h for h, kind in last.items() if kind == KVEventKind.REMOVED],
            )
            await bus.publish(kv_subject, msg)
        now = time.monotonic()
        if now - last_load >= LOAD_INTERVAL_S:
            last_load = now
            s, rate = llm.stats(), llm.step_rate()
            wait_s = rate.queue_wait_s(s.num_queued_tokens, s.num_running)
            if load_metrics is not None:
                load_metrics.load(
                    s.num_running, s.num_waiting, s.num_free_blocks, s.num_total_blocks
                )
                load_metrics.wait(wait_s, rate.prefill_tokens_per_s)
                load_metrics.host_tier(s.host_tier)
            await bus.publish(
                load_subject,
                events_pb2.LoadReport(
                    worker_id=worker_id,
                    num_waiting=s.num_waiting,
                    num_running=s.num_running,
                    free_blocks=s.num_free_blocks,
                    total_blocks=s.num_total_blocks,
                    queued_tokens=s.num_queued_tokens,
                    block_size=llm.block_size,
                    unix_ms=int(time.time() * 1000),
                    queue_wait_s=wait_s,
                    prefill_tokens_per_s=rate.prefill_tokens_per_s,
                    decode_step_s=rate.decode_step_s,
                    max_num_waiting=llm.max_num_waiting,
                ),
            )
