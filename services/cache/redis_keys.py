"""What Redis (T3) holds of the keys this cache instance wrote through to it, for the
master's index (services/cache/kv_feed.py publishes it as the instance's lower tier).

Redis tells nobody what it drops, so the instance keeps the keys it wrote with their expiry
(each write sets the TTL again) and checks them against Redis:

    written  key -> expires at (now + TTL)        after each write-through that succeeded
    expired  dropped at its expiry time, without asking (Redis no longer serves it either)
    evicted  (maxmemory, a flush, a Redis restart): found missing by `reconcile`, which
             asks EXISTS for every key held, every RECONCILE_INTERVAL_S

So the part of the index it feeds is never more than one interval behind Redis; while
Redis is unreachable nothing is dropped (its keys may be back with it), and the first
reconcile after drops what did not survive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from rtp_serve.services.cache.change_log import ChangeLog
from rtp_serve.services.cache.redis_tier import RedisTier

log = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 2.0
RECONCILE_BATCH = 4096  # keys per pipelined EXISTS round trip


class RedisKeys:
    def __init__(self, redis: RedisTier, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self._clock = clock
        self._expires: dict[bytes, float] = {}
        self.changes = ChangeLog()

    def take_events(self) -> list[tuple[bytes, bool]]:
        """(key, stored) for every key that entered or left the set since the last call."""
        return self.changes.take()

    def has_events(self) -> bool:
        """Whether take_events would return any."""
        return bool(self.changes)

    def __len__(self) -> int:
        return len(self._expires)

    def keys(self) -> list[bytes]:
        return list(self._expires)

    def written(self, keys: list[bytes]) -> None:
        """These keys were just written (each with the tier's TTL from now)."""
        expires = self._clock() + self.redis.ttl_s
        for key in keys:
            if key not in self._expires:
                self.changes.record(key, True)
            self._expires[key] = expires

    def expire(self) -> None:
        """Drop the keys whose TTL has run out."""
        now = self._clock()
        for key in [k for k, t in self._expires.items() if t <= now]:
            self._drop(key)

    async def reconcile(self) -> bool:
        """Drop the keys Redis no longer holds; False if Redis could not be asked."""
        self.expire()
        keys = list(self._expires)
        for start in range(0, len(keys), RECONCILE_BATCH):
            batch = keys[start : start + RECONCILE_BATCH]
            if not self.redis.available:
                return False
            present = await self.redis.exists_many(batch)
            if not self.redis.available:  # that call failed: all False means nothing
                return False
            for key, held in zip(batch, present, strict=True):
                if not held and key in self._expires:
                    self._drop(key)
        return True

    async def run(self, interval_s: float = RECONCILE_INTERVAL_S) -> None:
        """Reconcile every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.reconcile()

    def _drop(self, key: bytes) -> None:
        del self._expires[key]
        self.changes.record(key, False)
