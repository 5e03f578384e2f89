"""`CacheClient`: how prefill workers use the remote KV tier (the cache service instances).

Keys are sharded across instances with consistent hashing (`ring.HashRing`, virtual
nodes): unlike hash-mod-N, a membership change moves only about 1/N of the keys, from or
to the instance that joined or left, so the other instances' LRUs stay warm.

The remote tier is an optimisation: every call has a short deadline and any failure
(instance down, slow, bad reply) reads as "not cached", so the caller recomputes.

    keys   k0 k1 k2 k3 k4 k5          (one request's chained block keys, in order)
    shard   A  B  A  A  B  B
    A.Get(k0 k2 k3) -> k0 k2          B.Get(k1 k4 k5) -> k1 k4 k5
    prefix  k0 k1 k2 | k3 missing on A, so the answer stops there (k4, k5 are dropped)

Every block put is sealed with an integrity tag bound to its key (`integrity`, see
services/cache/integrity.py); the caller verifies what `get_prefix` returns before use.

Each instance gets one concurrent call with its keys in order, and answers with the longest
prefix of those it holds; the global prefix is where the first key is missing. Fetching
speculatively past it costs little: for a chained prefix cache, misses are nearly always
a suffix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from rtp_serve.services.cache import MAX_KEYS
from rtp_serve.services.cache.integrity import KVIntegrity
from rtp_serve.services.cache.ring import HashRing
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.kv_block_size import wire_nbytes_bound
from rtp_serve.services.common.pb import cache_pb2, cache_pb2_grpc, common_pb2

T = TypeVar("T")

log = logging.getLogger(__name__)

# Put batches are split below gRPC's message limit, and to at most this many blocks.
_MAX_PUT_BYTES = 64 << 20
_MAX_PUT_BLOCKS = 4096


class CacheClient:
    def __init__(
        self,
        addresses: Sequence[str] = (),
        *,
        timeout_s: float = 1.0,
        warn_interval_s: float = 30.0,
        integrity: KVIntegrity | None = None,
    ) -> None:
        self.integrity = integrity or KVIntegrity()
        self.timeout_s = timeout_s
        self.warn_interval_s = warn_interval_s
        self._addresses: list[str] = []
        self._ring = HashRing(())
        self._stubs: dict[str, cache_pb2_grpc.CacheStub] = {}
        self._channels = grpc_util.ChannelCache()
        self._last_warning: dict[str, float] = {}
        self.set_addresses(addresses)

    @property
    def addresses(self) -> list[str]:
        return list(self._addresses)

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Follow membership: shard over `addresses` from now on; close dropped channels."""
        self._ring = HashRing(addresses)
        self._addresses = self._ring.nodes
        for address in [a for a in self._stubs if a not in self._addresses]:
            del self._stubs[address]
            self._channels.drop(address, grace=self.timeout_s)

    def shard(self, block_hash: bytes) -> str:
        """The address responsible for `block_hash` (there must be at least one)."""
        return self._addresses[self._shard_index(block_hash)]

    async def put(self, blocks: Sequence[common_pb2.KVBlock]) -> int:
        """Store full blocks on their shards; returns how many were stored (0 on any error).

        Blocks without a block_hash (partial tail blocks) are skipped.
        """
        groups: dict[int, list[common_pb2.KVBlock]] = {}
        if self._addresses:
            blocks = [b for b in blocks if b.block_hash]
            await asyncio.to_thread(lambda: [self.integrity.seal(b) for b in blocks])
            for block in blocks:
                groups.setdefault(self._shard_index(block.block_hash), []).append(block)
        calls = [
            self._put(self._addresses[i], batch)
            for i, shard_blocks in groups.items()
            for batch in _batches(shard_blocks)
        ]
        return sum(await asyncio.gather(*calls))

    async def get_prefix(self, hashes: Sequence[bytes]) -> list[common_pb2.KVBlock]:
        """The blocks of the longest prefix of `hashes` held across the shards, in order."""
        hashes = list(hashes[:MAX_KEYS])
        groups = self._group(hashes)
        replies = await asyncio.gather(
            *(self._get(self._addresses[i], [hashes[p] for p in ps]) for i, ps in groups.items())
        )
        found: dict[int, common_pb2.KVBlock] = {}
        for positions, blocks in zip(groups.values(), replies, strict=True):
            for p, block in zip(positions, blocks, strict=False):
                if block.block_hash != hashes[p]:
                    break  # a misbehaving shard: trust none of the rest of its reply
                found[p] = block
        prefix: list[common_pb2.KVBlock] = []
        while len(prefix) in found:
            prefix.append(found[len(prefix)])
        return prefix

    async def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` are held across the shards (0 on any error)."""
        hashes = list(hashes[:MAX_KEYS])
        groups = self._group(hashes)
        counts = await asyncio.gather(
            *(self._exists(self._addresses[i], [hashes[p] for p in ps]) for i, ps in groups.items())
        )
        present: set[int] = set()
        for positions, n in zip(groups.values(), counts, strict=True):
            present.update(positions[:n])
        n = 0
        while n in present:
            n += 1
        return n

    async def __aenter__(self) -> CacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._stubs.clear()
        await self._channels.close()

    def _shard_index(self, block_hash: bytes) -> int:
        return self._ring.index(block_hash)

    def _group(self, hashes: list[bytes]) -> dict[int, list[int]]:
        """shard index -> positions in `hashes` it owns, ascending."""
        groups: dict[int, list[int]] = {}
        if self._addresses:
            for p, h in enumerate(hashes):
                groups.setdefault(self._shard_index(h), []).append(p)
        return groups

    def _stub(self, address: str) -> cache_pb2_grpc.CacheStub:
        stub = self._stubs.get(address)
        if stub is None:
            self._stubs[address] = stub = cache_pb2_grpc.CacheStub(self._channels.get(address))
        return stub

    async def _call(
        self, address: str, method: str, call: Callable[[Any], Awaitable[T]]
    ) -> T | None:
        """One RPC to one shard; None when it failed (down, slow, closed or a bad reply: all
        read as a miss, and are logged at a bounded rate)."""
        try:
            return await call(self._stub(address))
        except Exception as e:
            self._warn(address, method, e)
            return None

    async def _put(self, address: str, blocks: list[common_pb2.KVBlock]) -> int:
        request = cache_pb2.PutRequest(blocks=blocks)
        reply = await self._call(address, "Put", lambda s: s.Put(request, timeout=self.timeout_s))
        return reply.stored if reply is not None else 0

    async def _get(self, address: str, hashes: list[bytes]) -> list[common_pb2.KVBlock]:
        request = cache_pb2.GetRequest(block_hashes=hashes)
        reply = await self._call(address, "Get", lambda s: s.Get(request, timeout=self.timeout_s))
        return list(reply.blocks) if reply is not None else []

    async def _exists(self, address: str, hashes: list[bytes]) -> int:
        request = cache_pb2.ExistsRequest(block_hashes=hashes)
        reply = await self._call(
            address, "Exists", lambda s: s.Exists(request, timeout=self.timeout_s)
        )
        return min(reply.num_prefix, len(hashes)) if reply is not None else 0

    def _warn(self, address: str, method: str, error: Exception) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(address, float("-inf")) < self.warn_interval_s:
            return
        self._last_warning[address] = now
        detail = error.code().name if isinstance(error, grpc.aio.AioRpcError) else repr(error)
        log.warning("cache %s %s failed (%s); treating as a miss", address, method, detail)


def _batches(blocks: list[common_pb2.KVBlock]) -> list[list[common_pb2.KVBlock]]:
    """Split into Put requests of at most _MAX_PUT_BLOCKS blocks and ~_MAX_PUT_BYTES."""
    batches: list[list[common_pb2.KVBlock]] = [[]]
    size = 0
    for block in blocks:
        n = wire_nbytes_bound(block)
        if batches[-1] and (size + n > _MAX_PUT_BYTES or len(batches[-1]) >= _MAX_PUT_BLOCKS):
            batches.append([])
            size = 0
        batches[-1].append(block)
        size += n
    return batches if batches[-1] else []
