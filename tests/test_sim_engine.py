"""The simulated engine on the CPU, exactly: scripted steps of its scheduler over the real
block pool (prefix hits, events, eviction, preemption, PD delivery), and SimLLM's streams
with a zero-cost profile (no sleeping)."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from rtp_serve.core.block_hash import block_hash_keys
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.sim_cost import SimCost
from rtp_serve.engine.block_pool import BlockPool, KVEventKind
from rtp_serve.engine.errors import QueueFullError
from rtp_serve.engine.outputs import PromptKV
from rtp_serve.engine.sim.engine import SimConfig, SimLLM
from rtp_serve.engine.sim.scheduler import SimRequest, SimScheduler, SimStatus

BS = 4
FREE = SimCost(0, 0, 0, 0, 0, source="test: free steps")


def _scheduler(num_blocks: int = 8, budget: int = 64, seqs: int = 8) -> SimScheduler:
    pool = BlockPool(num_blocks, record_events=True)
    return SimScheduler(pool, BS, seqs, 4, budget, vocab_size=1000)


def _request(rid: str, prompt: list[int], max_tokens: int = 2, **kw) -> SimRequest:
    keys = block_hash_keys(prompt, BS)
    return SimRequest(rid, prompt, keys, SamplingParams(max_tokens=max_tokens), **kw)


def _run(s: SimScheduler) -> None:
    while work := s.schedule():
        s.complete(work)


def test_a_repeated_prompt_hits_its_cached_blocks_and_events_say_so():
    s = _scheduler()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    s.add(_request("a", prompt), held=False)
    _run(s)
    first = s.outbox
    assert [o.num_cached_tokens for o in first] == [0, 0]
    assert first[-1].finished and len([t for o in first for t in o.new_token_ids]) == 2
    stored = s.pool.take_events()
    assert [e.kind for e in stored] == [KVEventKind.STORED] * 2
    s.outbox = []
    s.add(_request("b", prompt), held=False)
    _run(s)
    assert s.outbox[0].num_cached_tokens == 2 * BS
    assert [t for o in s.outbox for t in o.new_token_ids] == [
        t for o in first for t in o.new_token_ids
    ]
    assert s.pool.take_events() == []  # nothing new stored
    s.pool.check_integrity()
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_eviction_is_lru_and_published():
    s = _scheduler(num_blocks=4)
    s.add(_request("a", list(range(8)), max_tokens=1), held=False)  # 2 blocks
    _run(s)
    a_keys = set(block_hash_keys(list(range(8)), BS))
    s.pool.take_events()
    s.add(_request("b", list(range(100, 116)), max_tokens=1), held=False)  # 4 blocks
    _run(s)
    events = s.pool.take_events()
    removed = {e.block_hash for e in events if e.kind == KVEventKind.REMOVED}
    assert removed == a_keys
    s.pool.check_integrity()


def test_no_room_preempts_the_newest_and_it_finishes_later():
    s = _scheduler(num_blocks=3, budget=64)
    s.add(_request("old", list(range(4)), max_tokens=6), held=False)  # grows to 3 blocks
    s.add(_request("new", list(range(50, 54)), max_tokens=6), held=False)
    _run(s)
    done = {o.request_id for o in s.outbox if o.finished}
    assert done == {"old", "new"}
    assert not s.requests and s.pool.num_free_blocks == 3
    s.pool.check_integrity()


def test_the_queue_limit_refuses():
    s = _scheduler()
    for i in range(4):
        s.add(_request(f"r{i}", [i, 1, 2]), held=False)
    with pytest.raises(QueueFullError):
        s.add(_request("r4", [9, 9]), held=False)


def test_pd_delivery_must_cover_exactly_the_uncached_prompt():
    s = _scheduler()
    prompt = list(range(10))
    s.add(_request("pd", prompt, remote_prefill=True), held=False)
    assert s.schedule() == []
    (reserved,) = s.outbox
    assert reserved.waiting_for_kv and s.requests["pd"].status == SimStatus.WAITING_FOR_KV
    short = np.zeros((1, 6, 1, 1), dtype=np.float32)
    with pytest.raises(ValueError):
        s.deliver_kv("pd", [PromptKV(0, short, short)], first=5)
    full = np.zeros((1, 10, 1, 1), dtype=np.float32)
    s.deliver_kv("pd", [PromptKV(0, full, full)], first=5)
    assert s.outbox[-1].new_token_ids == [5]
    _run(s)
    assert s.outbox[-1].finished and not s.requests
    assert len(s.pool.cached_hashes()) == 2  # the delivered prompt's full blocks


def test_cost_profile_round_trips_and_rejects_unknown_fields(tmp_path):
    path = tmp_path / "cost.json"
    cost = SimCost(0.001, 2e-5, 1e-6, 5e-4, 2e-6, source="x")
    cost.save(path)
    assert SimCost.load(path) == cost
    path.write_text(json.dumps({"fixed_s": 0.1, "bogus": 1}))
    with pytest.raises(ValueError):
        SimCost.load(path)
    with pytest.raises(ValueError):
        SimCost(fixed_s=-1)


def test_simllm_streams_exports_kv_and_checks_clean(model_dir):
    llm = SimLLM(SimConfig(str(model_dir("tiny-llama")), num_blocks=32, block_size=BS), FREE)
    prompt = list(range(20, 33))  # 3 full blocks + 1

    async def main():
        outs = [o async for o in llm.generate(prompt, SamplingParams(max_tokens=1), "p",
                                              export_kv_from=BS)]  # fmt: skip
        again = [o async for o in llm.generate(prompt, SamplingParams(max_tokens=3), "q")]
        return outs, again, await llm.check(), await llm.kv_snapshot()

    outs, again, check, (events, (device, host)) = asyncio.run(main())
    kv = outs[-1].prompt_kv
    assert kv.start == BS and kv.num_tokens == len(prompt) - BS
    assert kv.k[0, :, 0, 0].tolist() == prompt[BS:]
    assert again[0].num_cached_tokens == 3 * BS and again[-1].num_output_tokens == 3
    assert check.integrity_error == "" and check.num_held_blocks == 0
    assert set(device) == set(block_hash_keys(prompt, BS, llm.cache_salt)) and host == []


def test_a_prompt_the_pool_cannot_hold_is_refused(model_dir):
    llm = SimLLM(SimConfig(str(model_dir("tiny-llama")), num_blocks=8, block_size=BS), FREE)

    async def main():
        async for _ in llm.generate(list(range(40)), SamplingParams(max_tokens=1), "big"):
            pass

    with pytest.raises(ValueError, match="context length"):
        asyncio.run(main())
    assert llm.stats().num_waiting == 0


def test_a_warm_pool_holds_distinct_evictable_prompts_and_publishes_them(model_dir):
    llm = SimLLM(SimConfig(str(model_dir("tiny-llama")), num_blocks=32, block_size=BS), FREE)
    assert llm.warm(50, seed=1, prompt_blocks=8) == 32  # no more than the pool
    events = llm.pool.take_events()
    stored = [e.block_hash for e in events if e.kind == KVEventKind.STORED]
    assert len(stored) == len(set(stored)) == 32 == llm.pool.num_cached_blocks
    assert llm.pool.num_free_blocks == 32  # cached, but nothing holds them
    other = SimLLM(SimConfig(str(model_dir("tiny-llama")), num_blocks=32, block_size=BS), FREE)
    other.warm(32, seed=2, prompt_blocks=8)
    assert not set(other.pool.cached_hashes()) & set(stored)
    llm.pool.check_integrity()

    async def main():  # a request evicts the warm blocks it needs room for, LRU first
        async for _ in llm.generate(list(range(20, 36)), SamplingParams(max_tokens=1), "r"):
            pass
        return await llm.kv_snapshot()

    events, (device, _) = asyncio.run(main())
    removed = [e.block_hash for e in events if e.kind == KVEventKind.REMOVED]
    assert len(removed) == 4 and len(device) == 32 and set(removed) <= set(stored)


def test_a_burning_step_spends_its_time_on_a_core_and_the_loop_runs_meanwhile(model_dir):
    """step="burn": each step's profile time is spent as CPU time (so co-located workers
    share cores as real ones do), off the event loop, which keeps serving meanwhile."""
    cost = SimCost(fixed_s=0.1, prefill_token_s=0, prefill_attn_s=0, decode_row_s=0,
                   decode_ctx_s=0, source="test: 100 ms steps")  # fmt: skip
    config = SimConfig(str(model_dir("tiny-llama")), num_blocks=32, block_size=BS, step="burn")
    llm = SimLLM(config, cost)
    ticks = 0

    async def ticker(done: asyncio.Event) -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.005)

    async def main() -> None:
        done = asyncio.Event()
        task = asyncio.create_task(ticker(done))
        async for _ in llm.generate(list(range(20, 29)), SamplingParams(max_tokens=2), "b"):
            pass
        done.set()
        await task

    cpu = time.process_time()
    asyncio.run(main())
    assert time.process_time() - cpu >= 2 * 0.1  # two steps: the prompt's, one decode
    assert ticks >= 10  # the loop ran while the steps burned
    with pytest.raises(ValueError, match="step must be one of"):
        SimConfig(str(model_dir("tiny-llama")), step="nap")
