"""The `rtp.v1.Cache` gRPC service: an in-memory LRU (T2) written through to Redis (T3).

    Put:    LRU  <- blocks            Redis <- blocks (background, bounded; never awaited)
    Get:    LRU  -> longest prefix    Redis -> the rest of the prefix (promoted into the LRU)
    Exists: same walk as Get, without moving payloads

Redis is optional and may be down at any time: every Redis result degrades to "miss".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace

from rtp_serve.services.cache import MAX_KEYS, metrics
from rtp_serve.services.cache.kv_feed import CacheEventFeed
from rtp_serve.services.cache.lru import ByteLRU
from rtp_serve.services.cache.redis_keys import RedisKeys
from rtp_serve.services.cache.redis_tier import RedisTier
from rtp_serve.services.common.grpc_util import MAX_MESSAGE_BYTES
from rtp_serve.services.common.metrics import TIER_MEMORY, TIER_REDIS
from rtp_serve.services.common.pb import cache_pb2, cache_pb2_grpc, common_pb2, worker_pb2

log = logging.getLogger(__name__)

# A Get reply stops short of gRPC's message limit: a shorter prefix is still a valid answer.
MAX_REPLY_BYTES = MAX_MESSAGE_BYTES - (1 << 20)


class CacheServicer(cache_pb2_grpc.CacheServicer):
    def __init__(
        self,
        lru: ByteLRU,
        redis: RedisTier | None = None,
        *,
        max_keys: int = MAX_KEYS,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        max_pending_writes: int = 64,
        write_concurrency: int = 4,
    ) -> None:
        self.lru = lru
        self.redis = redis
        self.max_keys = max_keys
        self.max_reply_bytes = max_reply_bytes
        self.max_pending_writes = max_pending_writes
        self._write_slots = asyncio.Semaphore(write_concurrency)
        self._writes: set[asyncio.Task[None]] = set()
        self.feed: CacheEventFeed | None = None  # set when it publishes to the index
        self.redis_keys: RedisKeys | None = None  # likewise: what Redis holds of its writes
        self.promoted = 0  # blocks served from Redis and copied into the LRU
        self.dropped_writes = 0  # write-through batches skipped: Redis down or backlogged

    async def Put(
        self, request: cache_pb2.PutRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.PutReply:
        await self._check_count(len(request.blocks), "blocks", context)
        for i, block in enumerate(request.blocks):
            if not block.block_hash:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"blocks[{i}] has an empty block_hash: only full, hashed blocks are cached",
                )
        items = [(block.block_hash, block.SerializeToString()) for block in request.blocks]
        for key, value in items:
            self.lru.put(key, value)
        stored = sum(self.lru.contains(key) for key, _ in items)
        if self._write_through(items):
            stored = len(items)
        _trace(len(items), stored, (len(value) for _, value in items))
        return cache_pb2.PutReply(stored=stored)

    async def Get(
        self, request: cache_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.GetReply:
        hashes = await self._check_hashes(request.block_hashes, context)
        blocks = await self.get_prefix(hashes)
        _trace(len(hashes), len(blocks), (len(b.k) + len(b.v) for b in blocks))
        return cache_pb2.GetReply(blocks=blocks)

    async def Exists(
        self, request: cache_pb2.ExistsRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.ExistsReply:
        hashes = await self._check_hashes(request.block_hashes, context)
        return cache_pb2.ExistsReply(num_prefix=await self.exists_prefix(hashes))

    async def Snapshot(
        self, request: worker_pb2.KVSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KVSnapshot:
        if self.feed is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this cache instance publishes no KV events (started without --nats-url)",
            )
        return await self.feed.snapshot()

    async def get_prefix(self, hashes: list[bytes]) -> list[common_pb2.KVBlock]:
        """The blocks of the longest prefix of `hashes` held in the LRU or Redis, in order."""
        blocks: list[common_pb2.KVBlock] = []
        budget = self.max_reply_bytes
        for h in hashes:
            value = self.lru.get(h)
            if value is None:
                break
            budget -= len(value)
            if budget < 0:
                _count_lookup(len(blocks), 0, None)
                return blocks
            blocks.append(common_pb2.KVBlock.FromString(value))
        rest = hashes[len(blocks) :]
        if not rest or self.redis is None or not self.redis.available:
            _count_lookup(len(blocks), 0, TIER_MEMORY if rest else None)
            return blocks
        # Later keys may still be in the LRU (Redis may have missed a write-through), so
        # only the keys the LRU lacks go to Redis.
        local = [self.lru.peek(h) for h in rest]
        fetched = iter(
            await self.redis.get_many([h for h, v in zip(rest, local, strict=True) if v is None])
        )
        promoted, ended_in = self.promoted, None
        for h, value in zip(rest, local, strict=True):
            from_redis = value is None
            if from_redis:
                value = next(fetched)
            block = _parse(h, value)
            if block is None:
                ended_in = TIER_REDIS if from_redis else TIER_MEMORY
                break
            budget -= len(value)
            if budget < 0:
                break
            if from_redis:
                self.lru.put(h, value)
                self.promoted += 1
            blocks.append(block)
        via_redis = self.promoted - promoted
        _count_lookup(len(blocks) - via_redis, via_redis, ended_in)
        return blocks

    async def exists_prefix(self, hashes: list[bytes]) -> int:
        """How many leading `hashes` are held in the LRU or Redis."""
        n = 0
        while n < len(hashes) and self.lru.contains(hashes[n]):
            n += 1
        rest = hashes[n:]
        if not rest or self.redis is None or not self.redis.available:
            return n
        local = [self.lru.contains(h) for h in rest]
        found = iter(
            await self.redis.exists_many([h for h, hit in zip(rest, local, strict=True) if not hit])
        )
        for hit in local:
            if not (hit or next(found)):
                break
            n += 1
        return n

    async def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait up to `timeout_s` for pending write-throughs; True if none is left."""
        if self._writes:
            await asyncio.wait(set(self._writes), timeout=timeout_s)
        return all(task.done() for task in self._writes)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Let pending write-throughs finish (up to `timeout_s`), then cancel the rest."""
        if await self.flush(timeout_s):
            return
        pending = {task for task in self._writes if not task.done()}
        for task in pending:
            task.cancel()
        log.warning("dropped %d unfinished redis write-throughs at shutdown", len(pending))
        await asyncio.gather(*pending, return_exceptions=True)

    def _write_through(self, items: list[tuple[bytes, bytes]]) -> bool:
        """Schedule a background Redis write; False if skipped (no Redis, down, backlog)."""
        if self.redis is None or not items:
            return False
        if not self.redis.available or len(self._writes) >= self.max_pending_writes:
            self.dropped_writes += 1
            return False
        task = asyncio.get_running_loop().create_task(self._write(items))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return True

    async def _write(self, items: list[tuple[bytes, bytes]]) -> None:
        assert self.redis is not None
        async with self._write_slots:
            # Never raises; failures are logged there.
            if await self.redis.put_many(items) and self.redis_keys is not None:
                self.redis_keys.written([key for key, _ in items])

    async def _check_count(self, n: int, what: str, context: grpc.aio.ServicerContext) -> None:
        if n > self.max_keys:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"too many {what}: {n} in one call, at most {self.max_keys}; split the request",
            )

    async def _check_hashes(self, hashes, context: grpc.aio.ServicerContext) -> list[bytes]:
        await self._check_count(len(hashes), "block_hashes", context)
        hashes = list(hashes)
        for i, h in enumerate(hashes):
            if not h:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"block_hashes[{i}] is empty")
        return hashes


def _trace(asked: int, answered: int, sizes: Iterable[int]) -> None:
    """Put: blocks sent, stored; Get: keys asked, blocks found (a prefix); payload bytes
    (summed only when the span records)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(
            {
                "rtp.cache.blocks_asked": asked,
                "rtp.cache.blocks": answered,
                "rtp.cache.bytes": sum(sizes),
            }
        )


def _count_lookup(memory_hits: int, redis_hits: int, ended_in: str | None) -> None:
    """Account one Get's prefix walk: each block served from memory is a memory hit; one
    fetched from Redis a memory miss and a Redis hit; the key that ended the walk (not a
    budget stop) a miss in every tier that was asked for it (`ended_in`: the last one)."""
    ended = ended_in is not None
    metrics.cache_service().lookup(
        memory_hits,
        redis_hits + ended,
        redis_hits,
        int(ended_in == TIER_REDIS),
    )


def _parse(block_hash: bytes, value: bytes | None) -> common_pb2.KVBlock | None:
    """The stored block under `block_hash`, or None if absent, corrupt or mislabelled."""
    if value is None:
        return None
    try:
        block = common_pb2.KVBlock.FromString(value)
    except DecodeError:
        log.warning("dropping undecodable cached value for %s", block_hash.hex())
        return None
    if block.block_hash != block_hash:
        log.warning("dropping cached value stored under the wrong key %s", block_hash.hex())
        return None
    return block
