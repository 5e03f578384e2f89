"""A cache instance's part of the master's prefix index: its in-memory tier's (T2) changes
published as rtp.v1.KVEvents, and the snapshot (rtp.v1.KVSnapshot) the master resyncs from.

The same protocol as a worker's (services/worker/kv_events.py), under the instance's
member id: batches numbered 1, 2, 3, ... within one incarnation, a number spent even when
NATS drops the batch (the hole is how the master notices), and a snapshot that publishes
the pending changes first, so that snapshot(seq=S) == apply(batch 1..S). Keys are spread
over the instances by consistent hashing, so the master reads the remote tier as the union
of every instance's part. The keys it wrote through to Redis (T3) that Redis still holds
(services/cache/redis_keys.py) are its lower tier, in the fields a worker uses for its host
tier (`host_stored`, `host_removed`, `host_block_hashes`).
"""

from __future__ import annotations

import asyncio
import time

from rtp_serve.services.cache.lru import ByteLRU
from rtp_serve.services.cache.redis_keys import RedisKeys
from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import events_pb2, worker_pb2

EVENT_INTERVAL_S = 0.05  # as workers: at most 20 batches a second


class CacheEventFeed:
    def __init__(
        self,
        lru: ByteLRU,
        bus: Bus,
        cache_id: str,
        namespace: str = subjects.DEFAULT_NAMESPACE,
        incarnation: int | None = None,
        redis_keys: RedisKeys | None = None,
    ) -> None:
        self.lru = lru
        self.redis_keys = redis_keys
        self.bus = bus
        self.cache_id = cache_id
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.seq = 0  # the last batch numbered (published or dropped)
        self._subject = subjects.kv_events(cache_id, namespace)
        self._lock = asyncio.Lock()  # one batch numbered at a time

    async def flush(self) -> None:
        """Publish the changes since the last batch as the next one (none: nothing)."""
        async with self._lock:
            await self._publish(*self._take())

    def _take(self) -> tuple[list[tuple[bytes, bool]], list[tuple[bytes, bool]]]:
        lower = self.redis_keys.take_events() if self.redis_keys is not None else []
        return self.lru.take_events(), lower

    async def snapshot(self) -> worker_pb2.KVSnapshot:
        """Every key the instance holds in memory now, and the batch it is consistent with."""
        async with self._lock:
            # Taken together, with no await between: nothing changes either set meanwhile.
            events = self._take()
            keys = self.lru.keys()
            lower = self.redis_keys.keys() if self.redis_keys is not None else []
            await self._publish(*events)
            return worker_pb2.KVSnapshot(
                worker_id=self.cache_id, incarnation=self.incarnation, seq=self.seq,
                block_hashes=keys, host_block_hashes=lower,
            )  # fmt: skip

    async def run(self, interval_s: float = EVENT_INTERVAL_S) -> None:
        """Flush every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.flush()  # NATS down: the batch is dropped, its number spent (a gap)

    async def _publish(
        self, memory: list[tuple[bytes, bool]], redis: list[tuple[bytes, bool]]
    ) -> None:
        if not memory and not redis:
            return
        # Net the batch: only each key's last change in each tier counts.
        last, lower = dict(memory), dict(redis)
        self.seq += 1
        msg = events_pb2.KVEvents(
            worker_id=self.cache_id,
            seq=self.seq,
            incarnation=self.incarnation,
            stored=[k for k, stored in last.items() if stored],
            removed=[k for k, stored in last.items() if not stored],
            host_stored=[k for k, stored in lower.items() if stored],
            host_removed=[k for k, stored in lower.items() if not stored],
        )
        await self.bus.publish(self._subject, msg)
