"""`RedisTier`: the storage tier (T3) behind the cache service's in-memory LRU.

Values are serialized `rtp.v1.KVBlock` messages under `rtp:{namespace}:kv:{hash hex}`,
each with a TTL; Redis's own `maxmemory` policy bounds its size. A password (Redis's
`requirepass`) authenticates the connection. Values are data, never code: workers check
each block's integrity tag (`services/cache/integrity.py`) before using it.

Redis is an optimisation, never a dependency: every operation has a bounded timeout and
turns any failure into "miss" / "not written", with a rate-limited warning. After a failure
the tier is skipped for `retry_after_s` (so a dead or black-holed Redis does not add a
timeout to every request), then tried again; the client's connection pool reconnects by
itself once Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from rtp_serve.services.common.flags import redact

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TTL_S = 3600


class RedisTier:
    def __init__(
        self,
        url: str,
        namespace: str = "default",
        *,
        ttl_s: int = DEFAULT_TTL_S,
        timeout_s: float = 0.5,
        write_timeout_s: float = 5.0,
        retry_after_s: float = 1.0,
        warn_interval_s: float = 30.0,
        password: str | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.url = url
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        # Writes run in the background and carry whole blocks, so they may take longer
        # than a lookup without being a sign that Redis is down.
        self.write_timeout_s = write_timeout_s
        self.retry_after_s = retry_after_s
        self.warn_interval_s = warn_interval_s
        self.failures = 0
        self._skip_until = 0.0
        self._last_warning = float("-inf")
        self._down = False
        self._redis = aioredis.Redis.from_url(
            url,
            password=password,
            socket_timeout=max(timeout_s, write_timeout_s),
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # no hidden retries: we degrade instead
        )

    def key(self, block_hash: bytes) -> str:
        return f"rtp:{self.namespace}:kv:{block_hash.hex()}"

    @property
    def available(self) -> bool:
        """False while skipping Redis after a recent failure."""
        return time.monotonic() >= self._skip_until

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> bool:
        """SET each (block hash, serialized KVBlock) with the TTL; False if not written."""
        if not items:
            return True

        async def op() -> bool:
            async with self._redis.pipeline(transaction=False) as pipe:
                for block_hash, value in items:
                    pipe.set(self.key(block_hash), value, ex=self.ttl_s)
                await pipe.execute()
            return True

        return bool(await self._call("SET", op, self.write_timeout_s))

    async def get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        """The stored values in order (None where absent or Redis is unavailable)."""
        if not hashes:
            return []

        async def op() -> list[bytes | None]:
            return await self._redis.mget([self.key(h) for h in hashes])

        values = await self._call("MGET", op, self.timeout_s)
        return values if values is not None else [None] * len(hashes)

    async def exists_many(self, hashes: list[bytes]) -> list[bool]:
        """Presence of each key, in order; all False if Redis is unavailable."""
        if not hashes:
            return []

        async def op() -> list[bool]:
            # EXISTS with many keys only returns a count, so one EXISTS per key, pipelined.
            async with self._redis.pipeline(transaction=False) as pipe:
                for h in hashes:
                    pipe.exists(self.key(h))
                return [bool(n) for n in await pipe.execute()]

        found = await self._call("EXISTS", op, self.timeout_s)
        return found if found is not None else [False] * len(hashes)

    async def close(self) -> None:
        try:
            await self._redis.aclose()
        except Exception as e:  # closing a broken connection must not fail shutdown
            log.debug("closing redis: %s", e)

    async def _call(self, name: str, op: Callable[[], Awaitable[T]], timeout_s: float) -> T | None:
        if not self.available:
            return None
        try:
            async with asyncio.timeout(timeout_s):
                result = await op()
        except Exception as e:  # any failure (refused, timeout, protocol) is a miss
            self._failed(name, e)
            return None
        if self._down:
            self._down = False
            log.info("redis %s is reachable again", redact(self.url))
        return result

    def _failed(self, name: str, error: Exception) -> None:
        self.failures += 1
        self._down = True
        now = time.monotonic()
        self._skip_until = now + self.retry_after_s
        if now - self._last_warning >= self.warn_interval_s:
            self._last_warning = now
            log.warning(
                "redis %s unavailable (%s: %s); serving from memory only, retrying in %.1fs "
                "(%d failures so far)",
                redact(self.url),
                name,
                error.__class__.__name__ + (f": {error}" if str(error) else ""),
                self.retry_after_s,
                self.failures,
            )
