"""Which blocks a worker writes back to the remote tier (services/worker/tiers.py,
`--remote-write`): a real fused worker (DecodeServicer over gRPC, tiny-llama) beside a real
cache service (CacheServicer over gRPC, memory only), read back with the cache's Exists.

`reused` (the default) writes a prompt's blocks when the device pool serves them to a second
request, once; `computed` writes every block the worker computed, at its first use. The
engine exports only what the policy may write (engine/kv_export.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from rtp_serve.core.block_hash import block_hash_keys
from rtp_serve.engine import SamplingParams
from rtp_serve.engine.async_llm import AsyncLLM
from rtp_serve.engine.config import EngineConfig
from rtp_serve.engine.kv_export import KVExport, export_range
from rtp_serve.services.cache.client import CacheClient
from rtp_serve.services.cache.lru import ByteLRU
from rtp_serve.services.cache.servicer import CacheServicer
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.convert import params_to_pb
from rtp_serve.services.common.pb import (
    cache_pb2,
    cache_pb2_grpc,
    nameservice_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from rtp_serve.services.decode.servicer import DecodeServicer
from tests.servers import eventually

BS = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_export_ranges() -> None:
    # from 16, 48 tokens cached, a 100-token prompt
    assert export_range(KVExport.PROMPT, 16, 48, 100) == (16, 100)
    assert export_range(KVExport.COMPUTED, 16, 48, 100) == (48, 100)
    assert export_range(KVExport.COMPUTED, 64, 48, 100) == (64, 100)
    assert export_range(KVExport.REUSED, 16, 48, 100) == (16, 48)
    assert export_range(KVExport.REUSED, 16, 0, 100) == (16, 0)  # empty: nothing reused


class CountingCache(CacheServicer):
    """The cache service, counting the blocks put to it and the lookups asked of it."""

    def __init__(self) -> None:
        super().__init__(ByteLRU(64 << 20))
        self.blocks_put = 0
        self.gets = 0

    async def Put(self, request, context):
        self.blocks_put += len(request.blocks)
        return await super().Put(request, context)

    async def Get(self, request, context):
        self.gets += 1
        return await super().Get(request, context)


class Cluster:
    """One fused worker and one cache instance, in this process, over gRPC."""

    def __init__(self, llm: AsyncLLM, worker: str, cache: str, servicer: CountingCache) -> None:
        self.llm, self.worker, self.cache, self.cache_servicer = llm, worker, cache, servicer

    async def generate(
        self, prompt: list[int], rid: str, remote_blocks: int | None = None
    ) -> list[worker_pb2.GenerateResponse]:
        async with grpc_util.channel(self.worker) as ch:
            request = worker_pb2.GenerateRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                params=params_to_pb(GREEDY),
                remote_blocks=remote_blocks,
            )
            return [m async for m in worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=30)]

    async def stored(self, keys: list[bytes]) -> list[bool]:
        """Which of these keys the cache instance holds."""
        async with grpc_util.channel(self.cache) as ch:
            stub = cache_pb2_grpc.CacheStub(ch)
            return [
                (await stub.Exists(cache_pb2.ExistsRequest(block_hashes=[k]), timeout=5)).num_prefix
                == 1
                for k in keys
            ]

    async def settled(self, servicer: DecodeServicer) -> None:
        """Until the worker's background puts are done."""
        await eventually(lambda: servicer.tiers.pending_puts == 0, timeout=10)


@contextlib.asynccontextmanager
async def cluster(model: str, policy: str) -> AsyncIterator[tuple[Cluster, DecodeServicer]]:
    cache = CountingCache()
    cache_server, cache_port, _ = grpc_util.create_server("127.0.0.1:0")
    cache_pb2_grpc.add_CacheServicer_to_server(cache, cache_server)
    await cache_server.start()
    llm = await asyncio.to_thread(
        AsyncLLM, EngineConfig(model=model, block_size=BS, num_kv_blocks=64)
    )
    client = CacheClient([f"127.0.0.1:{cache_port}"])
    servicer = DecodeServicer(
        llm, allow_fused=True, role=nameservice_pb2.ROLE_FUSED, cache=client, remote_write=policy
    )
    server, port, _ = grpc_util.create_server("127.0.0.1:0")
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    await server.start()
    try:
        yield Cluster(llm, f"127.0.0.1:{port}", f"127.0.0.1:{cache_port}", cache), servicer
    finally:
        await server.stop(None)
        await client.close()
        await asyncio.to_thread(llm.shutdown)
        await cache_server.stop(None)
        await cache.close()


def _keys(llm: AsyncLLM, prompt: list[int]) -> list[bytes]:
    return block_hash_keys(prompt, BS, llm.salt_for())


def test_reused_blocks_are_written_at_their_second_use_and_once(model_dir, corpus_ids) -> None:
    shared = corpus_ids[:48]  # 3 full blocks, shared by every prompt below
    first, second, third = (shared + corpus_ids[100 + 30 * i : 130 + 30 * i] for i in range(3))

    async def main() -> None:
        async with cluster(str(model_dir("tiny-llama")), "reused") as (c, servicer):
            keys = _keys(c.llm, second)
            await c.generate(first, "a")
            await c.settled(servicer)
            assert await c.stored(keys) == [False] * 4  # a prompt used once: nothing written
            out = await c.generate(second, "b")
            assert out[-1].num_cached_tokens == 48  # the shared blocks came from the pool
            await c.settled(servicer)
            # The 3 reused blocks are written; the 4th (computed now, used once) is not.
            assert await c.stored(keys) == [True, True, True, False]
            assert c.cache_servicer.blocks_put == 3
            await c.generate(third, "c")  # reuses them again: already written, no put
            await c.settled(servicer)
            assert c.cache_servicer.blocks_put == 3
            assert servicer.tiers.export(keys[:3]) is None  # nothing left to write

    asyncio.run(main())


def test_computed_policy_writes_every_computed_block_at_first_use(model_dir, corpus_ids) -> None:
    prompt = corpus_ids[:70]  # 4 full blocks before the last token

    async def main() -> None:
        async with cluster(str(model_dir("tiny-llama")), "computed") as (c, servicer):
            keys = _keys(c.llm, prompt)
            await c.generate(prompt, "a")
            await c.settled(servicer)
            assert await c.stored(keys) == [True] * 4
            assert c.cache_servicer.blocks_put == 4

    asyncio.run(main())


def test_the_remote_tier_is_asked_only_for_what_the_route_says_it_may_hold(
    model_dir, corpus_ids
) -> None:
    """A request whose route says the remote tier holds no more of its prompt than the
    worker does (remote_blocks) is not looked up there, and is served; one whose route says
    more, or says nothing, is looked up. Each skip is counted."""
    from prometheus_client import REGISTRY

    def fresh(i: int) -> list[int]:
        return corpus_ids[100 * i : 100 * i + 70]  # 4 full blocks before the last token

    async def main() -> None:
        async with cluster(str(model_dir("tiny-llama")), "reused") as (c, servicer):
            labels = {"role": servicer.metrics.role, "model_name": servicer.metrics.model_name}

            def skipped() -> float:
                return REGISTRY.get_sample_value("rtp:remote_lookups_skipped_total", labels) or 0

            before = skipped()
            out = await c.generate(fresh(0), "none", remote_blocks=0)
            assert sum(len(m.token_ids) for m in out) == GREEDY.max_tokens
            assert c.cache_servicer.gets == 0 and skipped() == before + 1
            await c.generate(fresh(1), "unset")
            assert c.cache_servicer.gets == 1 and skipped() == before + 1
            await c.generate(fresh(2), "more", remote_blocks=3)
            assert c.cache_servicer.gets == 2 and skipped() == before + 1

    asyncio.run(main())


def test_an_unknown_policy_is_refused(model_dir) -> None:
    from rtp_serve.services.worker.tiers import Tiers

    with pytest.raises(ValueError, match="write policy 'always'"):
        Tiers(None, None, None, "always")  # type: ignore[arg-type]
