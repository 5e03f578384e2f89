"""The remote tier in the master's prefix index: a cache instance's in-memory tier (T2)
publishes its changes as sequenced KVEvents on NATS and serves Cache.Snapshot, and the
master's index follows it exactly, through a dropped batch and a master restart. Real NATS,
real gRPC; the master side is services.master.cluster.ClusterView as the master runs it.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

import redis.asyncio as aioredis

from rtp_serve.services.cache.kv_feed import CacheEventFeed
from rtp_serve.services.cache.lru import ByteLRU
from rtp_serve.services.cache.redis_keys import RedisKeys
from rtp_serve.services.cache.redis_tier import RedisTier
from rtp_serve.services.cache.servicer import CacheServicer
from rtp_serve.services.common import grpc_util, subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    events_pb2,
    worker_pb2,
)
from rtp_serve.services.common.pb import nameservice_pb2 as ns
from rtp_serve.services.master.cluster import ClusterView, SnapshotClient
from tests.servers import eventually

Ev = ns.MembershipEvent
VALUE_BYTES = 1000
CAPACITY = 8 * VALUE_BYTES + 500  # 8 blocks of the ones below: the 9th evicts the oldest


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(4, "big"), digest_size=16).digest()


def block(i: int) -> common_pb2.KVBlock:
    return common_pb2.KVBlock(block_hash=key(i), index=i, num_tokens=1, k=b"k" * 500, v=b"v" * 490)


@dataclass
class Cache:
    servicer: CacheServicer
    bus: Bus
    server: object
    address: str
    feeding: asyncio.Future

    @classmethod
    async def start(cls, nats_url: str, redis: RedisTier | None = None) -> Cache:
        servicer = CacheServicer(ByteLRU(CAPACITY, record_events=True), redis)
        server, port, _ = grpc_util.create_server("127.0.0.1:0")
        cache_pb2_grpc.add_CacheServicer_to_server(servicer, server)
        bus = await Bus.connect(nats_url, "cache-1")
        loops = []
        if redis is not None:
            servicer.redis_keys = RedisKeys(redis)
            loops.append(servicer.redis_keys.run(interval_s=0.1))
        servicer.feed = CacheEventFeed(servicer.lru, bus, "cache-1", redis_keys=servicer.redis_keys)
        loops.append(servicer.feed.run())
        await server.start()
        feeding = asyncio.gather(*loops)
        return cls(servicer, bus, server, f"127.0.0.1:{port}", feeding)

    @property
    def member(self) -> ns.Member:
        return ns.Member(id="cache-1", role=ns.ROLE_CACHE, address=self.address)

    async def put(self, *indices: int) -> None:
        async with grpc_util.channel(self.address) as ch:
            await cache_pb2_grpc.CacheStub(ch).Put(
                cache_pb2.PutRequest(blocks=[block(i) for i in indices]), timeout=5
            )

    async def stop(self) -> None:
        self.feeding.cancel()
        await asyncio.gather(self.feeding, return_exceptions=True)
        await self.server.stop(0)
        await self.bus.close()


async def master(
    nats_url: str, cache: Cache
) -> tuple[ClusterView, Bus, asyncio.Task, SnapshotClient]:
    view = ClusterView()
    view.apply_membership(Ev(kind=Ev.KIND_SNAPSHOT, member=cache.member))
    view.end_snapshot()
    bus = await Bus.connect(nats_url, "master")
    await view.subscribe(bus)
    fetch = SnapshotClient(timeout_s=2.0)
    return view, bus, asyncio.create_task(view.resync_forever(fetch)), fetch


async def converged(view: ClusterView, cache: Cache) -> None:
    def equal() -> bool:
        return view.index.hashes("cache-1") == set(cache.servicer.lru.keys())

    await eventually(equal, 10.0, "index == the cache's memory")
    view.check_integrity()


def test_the_index_follows_a_cache_instance_through_a_lost_batch_and_a_master_restart(
    nats_server,
):
    async def main() -> None:
        cache = await Cache.start(nats_server)
        view, bus, resync, fetch = await master(nats_server, cache)
        try:
            await cache.put(*range(6))
            await converged(view, cache)
            await cache.put(6, 7, 8, 9)  # 10 blocks in 8 slots: 0 and 1 evicted
            await converged(view, cache)
            assert not view.index.holds("cache-1", key(0))
            # A batch NATS loses: its changes are taken and never published, its number spent.
            await cache.put(10)
            cache.servicer.lru.take_events()
            cache.servicer.feed.seq += 1
            await cache.put(11)  # the next batch shows the gap: a resync from the snapshot
            await converged(view, cache)
            assert view.sync.stats.resyncs["gap"] == 1
            # The remote tier is the union of the instances: a worker that reads it can
            # fetch the prefix that only the cache holds (blocks 4..11 here).
            assert view.index.match_any([key(i) for i in range(4, 12)], ["cache-1"]) == 8
        finally:
            resync.cancel()
            await asyncio.gather(resync, return_exceptions=True)
            await fetch.close()
            await bus.close()
        # A master that starts again starts empty, and resyncs from the snapshot.
        view, bus, resync, fetch = await master(nats_server, cache)
        try:
            await converged(view, cache)
            assert view.sync.stats.resyncs["startup"] == 1
        finally:
            resync.cancel()
            await asyncio.gather(resync, return_exceptions=True)
            await fetch.close()
            await bus.close()
            await cache.stop()

    asyncio.run(main())


def test_the_index_follows_what_redis_still_holds_of_the_writes(nats_server, redis_server):
    """T3 is the cache's lower tier in the index: the keys it wrote through to Redis, less
    those Redis dropped (found missing within a reconcile interval) or let expire."""

    async def main() -> None:
        redis = RedisTier(redis_server, namespace="t3-index")
        cache = await Cache.start(nats_server, redis)
        view, bus, resync, fetch = await master(nats_server, cache)

        def lower() -> set[bytes]:
            return view.index.host.hashes("cache-1")

        try:
            await cache.put(*range(12))  # 12 written through; the memory keeps only 8
            await cache.servicer.flush()
            await eventually(lambda: lower() == {key(i) for i in range(12)}, 10.0, "T3 indexed")
            await converged(view, cache)
            # Redis drops two (maxmemory, say): the index follows within a reconcile.
            other = aioredis.Redis.from_url(redis_server)  # as an operator (or maxmemory) would
            await other.delete(redis.key(key(0)), redis.key(key(5)))
            await other.aclose()
            want = {key(i) for i in range(12)} - {key(0), key(5)}
            await eventually(lambda: lower() == want, 10.0, "evictions reconciled")
            # Blocks 0 and 1 left memory (evicted by 8..11) and block 0 left Redis: the
            # remote tier gives the prefix up to block 0 only; from 1 on it gives 1..4.
            assert view.index.match_any([key(i) for i in range(5)], ["cache-1"]) == 0
            assert view.index.match_any([key(i) for i in range(1, 5)], ["cache-1"]) == 4
            view.check_integrity()
        finally:
            resync.cancel()
            await asyncio.gather(resync, return_exceptions=True)
            await fetch.close()
            await bus.close()
            await cache.stop()
            await redis.close()

    asyncio.run(main())


def test_an_idle_feed_sleeps_and_a_change_wakes_it(nats_server):
    # An idle cache instance's feed does not look 20 times a second: it waits for the LRU
    # to say it changed, then publishes at once; evictions recorded by a later put come in
    # the next batch, after at most one interval.
    async def main() -> None:
        lru = ByteLRU(CAPACITY, record_events=True)
        bus = await Bus.connect(nats_server, "cache-1")
        listener = await Bus.connect(nats_server, "master")
        batches: list = []

        async def seen(msg, headers) -> None:
            batches.append(msg)

        await listener.subscribe(subjects.kv_events("cache-1"), events_pb2.KVEvents, seen)
        await listener.flush()
        feed = CacheEventFeed(lru, bus, "cache-1")
        looks = 0
        pending = feed._pending

        def counted() -> bool:
            nonlocal looks
            looks += 1
            return pending()

        feed._pending = counted  # type: ignore[method-assign]
        running = asyncio.create_task(feed.run(interval_s=0.05))
        try:
            await asyncio.sleep(0.3)
            assert looks == 0 and feed.seq == 0
            lru.put(key(1), b"x" * VALUE_BYTES)
            await eventually(lambda: len(batches) == 1, 5.0, "the first change published")
            assert list(batches[0].stored) == [key(1)] and looks == 1
            for i in range(2, 11):  # two more than fit: key(1) and key(2) are evicted
                lru.put(key(i), b"x" * VALUE_BYTES)
            await eventually(lambda: feed.seq == 2, 5.0, "the next batch")
            await eventually(lambda: len(batches) == 2, 5.0, "the next batch delivered")
            assert set(batches[1].removed) == {key(1), key(2)}
            assert set(batches[1].stored) == {key(i) for i in range(3, 11)}
            await asyncio.sleep(0.3)
            assert looks == 2 and feed.seq == 2
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await bus.close()
            await listener.close()

    asyncio.run(main())


def test_redis_keys_expire_with_their_ttl(redis_server):
    async def main() -> None:
        now = [0.0]
        redis = RedisTier(redis_server, namespace="t3-ttl", ttl_s=10)
        keys = RedisKeys(redis, clock=lambda: now[0])
        try:
            assert await redis.put_many([(key(1), b"x"), (key(2), b"y")])
            keys.written([key(1), key(2)])
            now[0] = 5.0
            keys.written([key(2)])  # written again: its TTL starts over
            assert keys.take_events() == [(key(1), True), (key(2), True)]
            now[0] = 10.0
            assert await keys.reconcile()
            assert keys.keys() == [key(2)] and keys.take_events() == [(key(1), False)]
        finally:
            await redis.close()

    asyncio.run(main())


def test_a_cache_without_a_feed_refuses_snapshots():
    async def main() -> None:
        servicer = CacheServicer(ByteLRU(CAPACITY))
        server, port, _ = grpc_util.create_server("127.0.0.1:0")
        cache_pb2_grpc.add_CacheServicer_to_server(servicer, server)
        await server.start()
        try:
            async with grpc_util.channel(f"127.0.0.1:{port}") as ch:
                try:
                    await cache_pb2_grpc.CacheStub(ch).Snapshot(worker_pb2.KVSnapshotRequest())
                except Exception as exc:
                    assert "publishes no KV events" in str(exc)
                else:
                    raise AssertionError("a snapshot of nothing was served")
        finally:
            await server.stop(0)

    asyncio.run(main())
