"""Prefix fetches from a lower tier overlap with queueing (engine/scheduler.py, `held`).

A request whose prefix is being fetched keeps its place in the queue while the requests
behind it go on; what the fetch gives it is imported when it lands and again right before
the request is admitted if it was evicted meanwhile; a failed fetch is a miss. The staged
KV comes from a second engine on the same model (what the cache service would hold).
"""

from __future__ import annotations

import asyncio

from rtp_serve.engine import SamplingParams
from rtp_serve.engine.async_llm import AsyncLLM
from rtp_serve.engine.config import EngineConfig
from rtp_serve.engine.llm_engine import LLMEngine
from rtp_serve.engine.outputs import PromptKV, StagedKV
from tests.helpers import assert_pool_idle, drive, engine_held, make_llm

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 16


def _staged(engine: LLMEngine, prompt: list[int], blocks: int) -> StagedKV:
    """The KV of the prompt's first `blocks` blocks, as another worker computed them."""
    request = engine.make_request("export", prompt, GREEDY, export_kv_from=0)
    engine.add_request(request)
    kv = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            kv = out.prompt_kv or kv
    assert kv is not None
    n = blocks * BS
    return StagedKV(request.block_hashes[:blocks], PromptKV(0, kv.k[:, :n], kv.v[:, :n]))


def test_staged_blocks_evicted_while_queued_are_imported_again_at_admission(model_dir, corpus_ids):
    """The fetch lands while the target waits behind a long prompt that pushes its blocks
    out of the 8-block pool; they are imported once more when it is admitted, so it hits
    all four, and its text is the one computed from scratch."""
    path = model_dir("tiny-llama")
    source = make_llm(path).engine
    target = corpus_ids[:70]  # 4 full blocks before the last token
    staged = _staged(source, target, 4)
    want, _ = drive(source, {0: [source.make_request("want", target, GREEDY)]})

    engine = make_llm(path, num_kv_blocks=8, max_num_seqs=1).engine
    held = engine.make_request("target", target, GREEDY)
    engine.add_request(held, held=True)
    assert engine.release_request("target", staged) == 4
    long = engine.make_request("long", corpus_ids[100:200], GREEDY, priority=-1)  # 7 blocks
    got, _ = drive(engine, {0: [long]})
    assert got["target"].num_cached_tokens == 64
    assert got["target"].token_ids == want["want"].token_ids
    assert_pool_idle(engine)


def test_a_fetch_overlaps_with_the_requests_behind_it(model_dir, corpus_ids):
    """While one request's fetch is in flight, a request that arrived after it is served;
    when the fetch lands, the first is served from what it brought."""
    path = model_dir("tiny-llama")
    target = corpus_ids[:70]
    staged = _staged(make_llm(path).engine, target, 4)
    llm = AsyncLLM(EngineConfig(model=str(path), block_size=BS, num_kv_blocks=64))

    async def run() -> None:
        landed = asyncio.Event()

        async def fetch() -> StagedKV:
            await landed.wait()
            return staged

        async def first() -> tuple[list[int], int]:
            tokens, cached = [], 0
            async for out in llm.generate(target, GREEDY, "held", prefetch=fetch):
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
            return tokens, cached

        held = asyncio.create_task(first())
        async for _ in llm.generate(corpus_ids[100:130], GREEDY, "behind"):
            pass
        assert not held.done()  # "behind" finished while "held" still waited
        landed.set()
        tokens, cached = await held
        assert cached == 64
        async for out in llm.generate(target, GREEDY, "plain"):
            assert out.num_cached_tokens == 64  # the imported blocks are in the prefix cache
        check = await llm.check()
        assert not check.integrity_error
        assert check.num_held_blocks == 0
        assert len(tokens) == GREEDY.max_tokens

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


def test_a_failed_fetch_is_a_miss(model_dir, corpus_ids):
    path = model_dir("tiny-llama")
    llm = AsyncLLM(EngineConfig(model=str(path), block_size=BS, num_kv_blocks=64))

    async def broken() -> StagedKV:
        raise ConnectionError("the cache service is gone")

    async def run() -> tuple[list[int], int]:
        tokens, cached = [], -1
        async for out in llm.generate(corpus_ids[:70], GREEDY, "r", prefetch=broken):
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
        return tokens, cached

    try:
        tokens, cached = asyncio.run(run())
    finally:
        llm.shutdown()
    assert (len(tokens), cached) == (GREEDY.max_tokens, 0)


def test_device_hits_count_what_a_request_reused_when_admitted(model_dir, corpus_ids):
    """Two requests for one prompt reach a worker during one step: both lookups miss, as
    nothing of it is computed yet, but the second, admitted once the first is done
    (max_num_seqs 1), reuses its four blocks, and the worker's device hits count them."""
    from prometheus_client import CollectorRegistry

    from rtp_serve.core.block_hash import block_hash_keys
    from rtp_serve.services.worker.metrics import WorkerFamilies, WorkerMetrics
    from rtp_serve.services.worker.tiers import Tiers

    registry = CollectorRegistry()
    config = EngineConfig(
        model=str(model_dir("tiny-llama")), block_size=BS, num_kv_blocks=64, max_num_seqs=1
    )
    llm = AsyncLLM(config)
    tiers = Tiers(llm, None, WorkerMetrics(WorkerFamilies(registry), "fused", "m"))
    target = corpus_ids[:70]  # 4 full blocks before the last token
    keys = block_hash_keys(target, BS, llm.engine.cache_salt)

    async def one(request_id: str):
        fetch = tiers.prefetch(target, keys)
        async for out in llm.generate(
            target, GREEDY, request_id, block_hashes=keys, prefetch=fetch
        ):
            fetch.admitted(out.num_cached_tokens)
            cached = out.num_cached_tokens
        return fetch.hits.device, cached

    async def main():
        async with engine_held(llm):
            runs = [asyncio.ensure_future(one(rid)) for rid in ("a", "b")]
            await asyncio.sleep(0.05)  # (both sent and looked up: nothing computed yet)
        return await asyncio.gather(*runs)

    try:
        looked_up, reused = zip(*asyncio.run(main()), strict=True)
    finally:
        llm.shutdown()
    assert looked_up == (0, 0) and reused == (0, 64)
    labels = {"role": "fused", "model_name": "m", "tier": "device"}
    assert registry.get_sample_value("rtp:prefix_cache_hits_total", labels) == 4
    assert registry.get_sample_value("rtp:prefix_cache_queries_total", labels) == 8


def test_a_lookup_is_answered_while_the_engine_is_mid_step(model_dir, corpus_ids):
    """A request's tier lookup reads the pool from the worker's loop, not through the engine
    thread: with the engine busy (as in a long prefill step of a burst), it still ends, so
    the request is released for admission at the next step, not one or two steps later."""
    from prometheus_client import CollectorRegistry

    from rtp_serve.core.block_hash import block_hash_keys
    from rtp_serve.services.worker.metrics import WorkerFamilies, WorkerMetrics
    from rtp_serve.services.worker.tiers import Tiers

    config = EngineConfig(model=str(model_dir("tiny-llama")), block_size=BS, num_kv_blocks=64)
    llm = AsyncLLM(config)
    metrics = WorkerMetrics(WorkerFamilies(CollectorRegistry()), "fused", "m")
    tiers = Tiers(llm, None, metrics)
    cached, fresh = corpus_ids[:70], corpus_ids[100:170]  # 4 full blocks before the last
    salt = llm.engine.cache_salt

    async def main():
        async for _ in llm.generate(cached, GREEDY, "warm"):
            pass
        async with engine_held(llm):
            hits = []
            for prompt in (cached, fresh):
                fetch = tiers.prefetch(prompt, block_hash_keys(prompt, BS, salt))
                assert await asyncio.wait_for(fetch(), 5) is None  # nothing to import
                hits.append(fetch.hits.device)
        return hits

    try:
        assert asyncio.run(main()) == [4, 0]
    finally:
        llm.shutdown()


def test_write_back_yields_while_requests_wait(model_dir, corpus_ids):
    """A worker writes computed prompts back to the remote tier only while nothing waits for
    its engine: a saturated worker serves first, and counts what it skipped."""
    from prometheus_client import CollectorRegistry

    from rtp_serve.services.cache.client import CacheClient
    from rtp_serve.services.worker.metrics import WorkerFamilies, WorkerMetrics
    from rtp_serve.services.worker.tiers import Tiers

    registry = CollectorRegistry()
    metrics = WorkerMetrics(WorkerFamilies(registry), "fused", "m")
    config = EngineConfig(model=str(model_dir("tiny-llama")), block_size=BS, num_kv_blocks=64)
    llm = AsyncLLM(config)
    tiers = Tiers(llm, CacheClient(), metrics)

    async def main() -> list[bool]:
        seen = [tiers.writes_back()]  # idle
        async with engine_held(llm):
            run = asyncio.ensure_future(_drain(llm.generate(corpus_ids[:40], GREEDY, "w")))
            while not llm.stats().num_waiting:  # until it is sent, waiting in the inbox
                await asyncio.sleep(0)
            seen.append(tiers.writes_back())
        await run
        seen.append(tiers.writes_back())  # done: idle again
        return seen

    try:
        assert asyncio.run(main()) == [True, False, True]
        assert not Tiers(llm, None, metrics).writes_back()  # no remote tier at all
    finally:
        llm.shutdown()
    labels = {"role": "fused", "model_name": "m"}
    assert registry.get_sample_value("rtp:kv_writeback_skipped_total", labels) == 1


async def _drain(outputs) -> None:
    async for _ in outputs:
        pass
