"""The remote KV tier: ByteLRU (exact), the Cache service over a real Redis, CacheClient.

Everything is real: grpc.aio servers on free ports, a redis-server process per test that
needs one (killed and restarted where the test says so), service processes, no mocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis

from rtp_serve.core.block_hash import block_hash_keys
from rtp_serve.services.cache.client import CacheClient
from rtp_serve.services.cache.lru import ByteLRU, LRUStats
from rtp_serve.services.cache.redis_tier import RedisTier
from rtp_serve.services.cache.servicer import CacheServicer
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.naming import NameClient
from rtp_serve.services.common.pb import cache_pb2, cache_pb2_grpc, common_pb2, nameservice_pb2
from rtp_serve.services.launcher.servers import ManagedProcess, free_port
from tests import procs, servers

BLOCK_BYTES = 2 * 16 * 2 * 4 * 4  # [layers=2, tokens=16, kv_heads=2, head_dim=4] float32
Blocks = list[common_pb2.KVBlock]


def async_test(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body on a fresh event loop, bounded to 20 s."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        async def bounded() -> None:
            async with asyncio.timeout(20):
                await fn(*args, **kwargs)

        asyncio.run(bounded())

    return wrapper


def make_blocks(n: int, seed: int = 0) -> Blocks:
    hashes = block_hash_keys(list(range(seed, seed + 16 * n)), 16, salt=b"test")
    kv = [bytes([(seed + i) % 256]) * BLOCK_BYTES for i in range(n + 1)]
    return [
        common_pb2.KVBlock(block_hash=h, index=i, num_tokens=16, dtype="float32",
                           shape=[2, 16, 2, 4], k=kv[i], v=kv[i + 1])
        for i, h in enumerate(hashes)
    ]  # fmt: skip


def keys(blocks: Blocks) -> list[bytes]:
    return [b.block_hash for b in blocks]


def serialized(blocks: Blocks) -> list[bytes]:
    return [b.SerializeToString() for b in blocks]


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[ManagedProcess]:
    with servers.redis(tmp_path / "redis") as proc:
        yield proc


@pytest.fixture
def hung_address() -> Iterator[str]:
    """Accepts TCP connections (into the kernel backlog) but never answers: a stuck server."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        yield f"127.0.0.1:{hung.getsockname()[1]}"


@dataclass(slots=True)
class Cache:
    """A running in-process cache service, called over gRPC; integrity checked every call."""

    servicer: CacheServicer
    address: str
    stub: cache_pb2_grpc.CacheStub

    async def put(self, blocks: Blocks) -> int:
        reply = await self.stub.Put(cache_pb2.PutRequest(blocks=blocks), timeout=5)
        self.servicer.lru.check_integrity()
        return reply.stored

    async def get(self, hashes: list[bytes]) -> list[bytes]:
        reply = await self.stub.Get(cache_pb2.GetRequest(block_hashes=hashes), timeout=5)
        self.servicer.lru.check_integrity()
        return serialized(list(reply.blocks))

    async def exists(self, hashes: list[bytes]) -> int:
        reply = await self.stub.Exists(cache_pb2.ExistsRequest(block_hashes=hashes), timeout=5)
        return reply.num_prefix


@contextlib.asynccontextmanager
async def cache_server(
    redis_url: str | None = None, capacity: int = 1 << 20, **kw: int
) -> AsyncIterator[Cache]:
    tier = RedisTier(redis_url, "t", retry_after_s=0.1) if redis_url else None
    servicer = CacheServicer(ByteLRU(capacity), tier, **kw)
    server, port, _ = grpc_util.create_server("127.0.0.1:0")
    cache_pb2_grpc.add_CacheServicer_to_server(servicer, server)
    await server.start()
    try:
        async with grpc_util.channel(f"127.0.0.1:{port}") as ch:
            yield Cache(servicer, f"127.0.0.1:{port}", cache_pb2_grpc.CacheStub(ch))
    finally:
        await server.stop(None)
        await servicer.close()
        if tier is not None:
            await tier.close()
        servicer.lru.check_integrity()


async def in_redis(url: str, blocks: Blocks, namespace: str = "t") -> bool:
    """True if every block is stored in Redis, byte for byte, under its key."""
    r = aioredis.Redis.from_url(url)
    try:
        return await r.mget([f"rtp:{namespace}:kv:{h.hex()}" for h in keys(blocks)]) == (
            serialized(blocks)
        )
    finally:
        await r.aclose()


# (operation, key, value size, expected result, keys from the LRU end after it, bytes used)
LRU_SCRIPT = [
    ("put", b"a", 40, [], [b"a"], 40),
    ("put", b"b", 40, [], [b"a", b"b"], 80),
    ("get", b"a", 0, b"a" * 40, [b"b", b"a"], 80),  # a becomes MRU
    ("put", b"c", 40, [b"b"], [b"a", b"c"], 80),  # 120 > 100: the LRU end goes
    ("get", b"b", 0, None, [b"a", b"c"], 80),
    ("put", b"a", 10, [], [b"c", b"a"], 50),  # replaced: re-sized and moved to MRU
    ("peek", b"c", 0, b"c" * 40, [b"c", b"a"], 50),  # no refresh
    ("put", b"d", 100, [b"c", b"a"], [b"d"], 100),  # exactly the capacity: all else goes
    ("put", b"e", 101, [], [b"d"], 100),  # larger than the capacity: refused, d kept
    ("put", b"d", 101, [], [], 0),  # an oversized replacement drops the old value
]


def test_lru_exact_eviction_order_and_counters() -> None:
    lru = ByteLRU(100)
    for i, (op, key, size, result, order, used) in enumerate(LRU_SCRIPT):
        args = (key, key * size) if op == "put" else (key,)
        assert getattr(lru, op)(*args) == result, i
        lru.check_integrity()
        assert lru.keys() == order and lru.bytes_used == used, i
    assert lru.stats == LRUStats(hits=1, misses=1, evictions=3, rejected=2)
    lru.put(b"k", b"12345")
    lru.bytes_used += 1  # the integrity check catches broken accounting
    with pytest.raises(AssertionError):
        lru.check_integrity()
    with pytest.raises(ValueError):
        ByteLRU(0)


@async_test
async def test_put_get_exists_longest_prefix_and_validation() -> None:
    blocks = make_blocks(4)
    hashes = keys(blocks)
    async with cache_server(max_keys=8) as c:
        assert await c.put([blocks[0], blocks[1], blocks[3]]) == 3
        assert await c.get(hashes[:2]) == serialized(blocks[:2])  # identical bytes
        assert await c.get(hashes) == serialized(blocks[:2])  # stops at the hole
        assert await c.get(hashes[2:]) == []
        assert await c.exists(hashes) == 2 and await c.exists([]) == 0
        assert await c.exists([hashes[3], hashes[0]]) == 2
        bad = [(c.put, [blocks[2], common_pb2.KVBlock(k=b"tail")], "blocks[1] has an empty")]
        bad += [(c.get, hashes * 3, "too many block_hashes: 12 in one call, at most 8")]
        bad += [(c.exists, hashes * 3, "too many block_hashes"), (c.get, [b""], "[0] is empty")]
        for rpc, arg, message in bad:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rpc(arg)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details()
        assert await c.get(hashes) == serialized(blocks[:2])  # nothing of the bad Put stored


@async_test
async def test_evicted_blocks_are_served_from_redis_and_promoted(
    redis_proc: ManagedProcess,
) -> None:
    blocks = make_blocks(4)
    hashes = keys(blocks)
    size = max(b.ByteSize() for b in blocks)  # index 0 encodes shorter
    async with cache_server(redis_proc.url, capacity=2 * size) as c:
        assert await c.put(blocks) == 4
        assert await c.servicer.flush() and await in_redis(redis_proc.url, blocks)
        assert c.servicer.lru.keys() == hashes[2:]  # the first two were evicted
        assert await c.exists(hashes) == 4
        assert await c.get(hashes[:1]) == serialized(blocks[:1])
        assert c.servicer.promoted == 1 and c.servicer.lru.keys() == [hashes[3], hashes[0]]
        # All four come back in order, though only two fit in memory at a time.
        assert await c.get(hashes) == serialized(blocks)
        # h0 hit; h1, h2 promoted in order (evicting h3, then h0); h3 served as peeked.
        assert c.servicer.lru.keys() == hashes[1:3]
        assert await c.get([hashes[0], *keys(make_blocks(1, 99))]) == serialized(blocks[:1])


@async_test
async def test_dead_redis_degrades_to_memory_and_write_through_resumes(
    redis_proc: ManagedProcess, tmp_path: Path
) -> None:
    first, during, after = make_blocks(2), make_blocks(2, seed=10), make_blocks(2, seed=20)
    async with cache_server(redis_proc.url) as c:
        assert await c.put(first) == 2 and await c.servicer.flush()
        redis_proc.stop()
        started = time.monotonic()
        await c.put(during)  # no error; the write-through fails in the background
        assert await c.servicer.flush()
        for blocks in (first, during):
            assert await c.get(keys(blocks)) == serialized(blocks)
        unknown = keys(make_blocks(2, seed=30))
        assert await c.get(unknown) == [] and await c.exists(unknown) == 0
        assert time.monotonic() - started < 2.0
        assert c.servicer.redis is not None and c.servicer.redis.failures >= 1

        with servers.redis(tmp_path / "redis2", port=redis_proc.port):

            async def resumed() -> bool:
                await c.put(after)  # the tier retries Redis 0.1 s after a failure
                await c.servicer.flush()
                return await in_redis(redis_proc.url, after)

            await servers.eventually(resumed, what="write-through resumed")
            for h in keys(after):  # reads use Redis again too
                c.servicer.lru.remove(h)
            assert await c.get(keys(after)) == serialized(after)
            assert c.servicer.promoted == 2


@async_test
async def test_hung_redis_costs_a_bounded_timeout_then_is_skipped(hung_address: str) -> None:
    blocks = make_blocks(2)
    async with cache_server(f"redis://{hung_address}") as c:
        tier = c.servicer.redis
        tier.timeout_s, tier.write_timeout_s, tier.retry_after_s = 0.3, 0.6, 30.0
        started = time.monotonic()
        assert await c.put(blocks) == 2  # replies before the write-through gives up
        assert time.monotonic() - started < 0.5
        assert await c.get(keys(blocks)) == serialized(blocks)
        started = time.monotonic()
        assert await c.get(keys(make_blocks(1, seed=50))) == []  # MGET times out: a miss
        assert 0.25 < time.monotonic() - started < 1.0
        started = time.monotonic()
        assert await c.exists(keys(make_blocks(1, seed=50))) == 0  # Redis skipped meanwhile
        assert time.monotonic() - started < 0.25 and tier.failures >= 1


@async_test
async def test_client_shards_across_two_instances_and_returns_the_prefix() -> None:
    blocks = make_blocks(16)
    hashes = keys(blocks)
    async with (
        cache_server() as a,
        cache_server() as b,
        CacheClient([b.address, a.address], timeout_s=2.0) as client,
    ):
        assert client.addresses == sorted([a.address, b.address])
        assert await client.put([*blocks, common_pb2.KVBlock(k=b"tail")]) == 16
        assert len(a.servicer.lru) > 0 and len(b.servicer.lru) > 0
        for c in (a, b):  # each instance holds exactly the keys it owns
            owned = [h for h in hashes if client.shard(h) == c.address]
            assert sorted(c.servicer.lru.keys()) == sorted(owned)
        assert serialized(await client.get_prefix(hashes)) == serialized(blocks)
        assert await client.exists_prefix(hashes) == 16
        owner = a if client.shard(hashes[5]) == a.address else b
        owner.servicer.lru.remove(hashes[5])
        assert serialized(await client.get_prefix(hashes)) == serialized(blocks[:5])
        assert await client.exists_prefix(hashes) == 5
        assert await client.get_prefix([]) == []
        client.set_addresses([a.address])  # b left: only a's keys can be found
        lead = next((i for i, h in enumerate(hashes) if b.servicer.lru.contains(h)), 16)
        got = await client.get_prefix(hashes)
        assert serialized(got) == serialized(blocks[: min(lead, 5)])


def test_sharding_moves_only_the_departed_instances_keys() -> None:
    hashes, three = keys(make_blocks(300)), CacheClient(["h1:1", "h2:2", "h3:3"])
    before = {h: three.shard(h) for h in hashes}
    assert min(list(before.values()).count(a) for a in three.addresses) > 60  # balanced
    three.set_addresses(["h1:1", "h3:3"])
    assert all(three.shard(h) == before[h] for h in hashes if before[h] != "h2:2")


@async_test
async def test_client_with_dead_or_hung_instances_returns_empty_within_deadline(
    hung_address: str,
) -> None:
    blocks = make_blocks(12)
    hashes = keys(blocks)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    for address in (dead, hung_address):
        async with CacheClient([address], timeout_s=0.3) as client:
            started = time.monotonic()
            assert await client.put(blocks) == 0
            assert await client.get_prefix(hashes) == []
            assert await client.exists_prefix(hashes) == 0
            assert time.monotonic() - started < 3 * 0.3 + 1.0
    async with cache_server() as live, CacheClient([live.address, dead], timeout_s=0.3) as client:
        await client.put(blocks)
        n = next((i for i, h in enumerate(hashes) if client.shard(h) == dead), 12)
        assert serialized(await client.get_prefix(hashes)) == serialized(blocks[:n])
        assert await client.exists_prefix(hashes) == n


def test_cache_process_registers_serves_and_deregisters(redis_proc: ManagedProcess) -> None:
    blocks = make_blocks(3)

    async def members_are(names: NameClient, expected: list[str]) -> bool:
        return [m.address for m in await names.list(nameservice_pb2.ROLE_CACHE)] == expected

    @async_test
    async def check(ns: str, address: str | None) -> None:
        async with NameClient(ns) as names:
            expected = [address] if address else []
            await servers.eventually(lambda: members_are(names, expected), what="membership")
        if address is not None:
            async with CacheClient([address]) as client:
                assert await client.put(blocks) == 3
                assert serialized(await client.get_prefix(keys(blocks))) == serialized(blocks)
            # Written through to the Redis given by --redis-url, in its --namespace.
            await servers.eventually(lambda: in_redis(redis_proc.url, blocks, "p"), what="redis")

    with procs.grpc_service("nameservice") as (ns, _):
        flags = ("--nameservice", ns, "--redis-url", redis_proc.url, "--namespace", "p")
        with procs.grpc_service("cache", *flags, "--capacity-mib", "1") as (address, proc):
            check(ns, address)
        assert proc.returncode == 0  # SIGTERM: clean shutdown
        check(ns, None)  # and it deregistered on the way out


def test_cache_main_does_not_import_torch() -> None:
    code = "import sys, rtp_serve.services.cache.main, rtp_serve.services.cache.client; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
