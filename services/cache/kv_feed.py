"""A cache instance's part of the master's prefix index: its in-memory tier's (T2) changes
published as rtp.v1.KVEvents, and the snapshot (rtp.v1.KVSnapshot) the master resyncs from.

The numbering, netting and snapshot protocol are services/common/kv_feed.py's, under the
instance's member id. Keys are spread over the instances by consistent hashing, so the
master reads the remote tier as the union of every instance's part. The keys it wrote
through to Redis (T3) that Redis still holds (services/cache/redis_keys.py) are its lower
tier, in the fields a worker uses for its host tier (`host_stored`, `host_removed`,
`host_block_hashes`).
"""

from __future__ import annotations

from rtp_serve.services.cache.lru import ByteLRU
from rtp_serve.services.cache.redis_keys import RedisKeys
from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.kv_feed import EVENT_INTERVAL_S, Changes, Held, KVFeed

__all__ = ["EVENT_INTERVAL_S", "CacheEventFeed"]


class CacheEventFeed(KVFeed):
    def __init__(
        self,
        lru: ByteLRU,
        bus: Bus,
        cache_id: str,
        namespace: str = subjects.DEFAULT_NAMESPACE,
        incarnation: int | None = None,
        redis_keys: RedisKeys | None = None,
    ) -> None:
        super().__init__(bus, cache_id, namespace, incarnation)
        self.lru = lru
        self.redis_keys = redis_keys
        for changes in (lru.changes, redis_keys.changes if redis_keys is not None else None):
            if changes is not None:
                changes.on_change = self.notify

    @property
    def cache_id(self) -> str:
        return self.member_id

    def _drain(self) -> Changes:
        lower = self.redis_keys.take_events() if self.redis_keys is not None else []
        return Changes(self.lru.take_events(), lower)

    async def _take(self) -> Changes:
        return self._drain()

    def _pending(self) -> bool:
        return self.lru.has_events() or (
            self.redis_keys is not None and self.redis_keys.has_events()
        )

    async def _held(self) -> Held:
        # Taken together, with no await between: nothing changes either set meanwhile.
        changes = self._drain()
        lower = self.redis_keys.keys() if self.redis_keys is not None else []
        return Held(changes, self.lru.keys(), lower)
