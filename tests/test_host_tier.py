"""T1, the host-memory tier under the device pool (engine/host_tier.py): blocks the pool
evicts spill there and come back up on a prefix hit, giving the same output."""

from __future__ import annotations

import pytest
import torch

from rtp_serve.engine import SamplingParams
from rtp_serve.engine.host_tier import HostTier
from rtp_serve.engine.outputs import PromptKV
from tests.helpers import assert_pool_idle, make_llm

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _block(value: float) -> PromptKV:
    k = torch.full((2, 4, 1, 8), value)  # 2 layers x 4 tokens x 1 head x 8 = 256 bytes each
    return PromptKV(0, k, k.clone())


def test_lru_by_bytes_and_leading_hits_only():
    tier = HostTier(capacity_bytes=3 * 512)  # three blocks of K + V
    for name in (b"a", b"b", b"c"):
        tier.put(name, _block(1.0))
    assert [float(kv.k[0, 0, 0, 0]) for kv in tier.lookup([b"a", b"b"])] == [1.0, 1.0]
    tier.put(b"d", _block(2.0))  # evicts c: a and b were just used
    assert b"c" not in tier and b"a" in tier and b"d" in tier
    assert len(tier.lookup([b"a", b"c", b"d"])) == 1  # a hit, then a miss ends the prefix
    s = tier.stats()
    assert (s.num_blocks, s.used_bytes, s.hits, s.misses, s.stored, s.evicted) == (
        3, 1536, 3, 1, 4, 1,
    )  # fmt: skip
    tier.check_integrity()
    HostTier(capacity_bytes=100).put(b"x", _block(0.0))  # larger than the tier: not kept


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_evicted_blocks_come_back_from_the_host_tier(model_dir, corpus_ids, hf_greedy, kv_dtype):
    """A prompt's blocks are pushed out of a small device pool by other prompts; asked again,
    they are copied up from T1 (hits counted as cached tokens) and the output is the same.
    Without T1 the same sequence recomputes them."""
    target = corpus_ids[:70]  # four full blocks and a tail
    others = [corpus_ids[100 + 40 * i : 140 + 40 * i] for i in range(3)]
    results = {}
    for host_bytes in (0, 8 << 20):
        llm = make_llm(
            model_dir("tiny-llama"), num_kv_blocks=8, kv_dtype=kv_dtype,
            host_kv_cache_bytes=host_bytes,
        )  # fmt: skip
        engine = llm.engine
        [first] = llm.generate([target], GREEDY)
        for prompt in others:  # 3 blocks each: the target's blocks are evicted
            llm.generate([prompt], GREEDY)
            engine.check_integrity()
        [again] = llm.generate([target], GREEDY)
        engine.check_integrity()
        assert again.token_ids == first.token_ids
        if kv_dtype == "auto":
            assert first.token_ids == hf_greedy("tiny-llama", target, 8)[0]
        results[host_bytes] = again.num_cached_tokens, engine.stats().host_tier
        assert_pool_idle(engine)
    assert results[0] == (0, None)
    cached, tier = results[8 << 20]
    assert cached == 64  # every full block the prompt can hit came from T1
    assert tier.hits == 4 and tier.stored >= 4 and tier.used_bytes <= tier.capacity_bytes


def test_a_lookup_counts_what_t1_holds_and_admission_copies_it_up(model_dir, corpus_ids):
    """peek_cached_prefix (what a worker asks before going to the remote tier, from its
    own thread) counts blocks T1 holds without moving them; the request, admitted, gets
    them copied up and hits every one."""
    from rtp_serve.core.block_hash import block_hash_keys

    llm = make_llm(model_dir("tiny-llama"), num_kv_blocks=6, host_kv_cache_bytes=8 << 20)
    engine = llm.engine
    target = corpus_ids[:70]  # 4 full blocks before the last token
    (first,) = llm.generate([target], GREEDY)
    llm.generate([corpus_ids[100:180]], GREEDY)  # 5 blocks + : evicts the target's
    keys = block_hash_keys(target, 16, engine.cache_salt)
    assert all(engine.pool.get_cached(h) is None for h in keys[:2])
    assert engine.tiers.peek_cached_prefix(keys) == 4
    assert all(engine.pool.get_cached(h) is None for h in keys[:2])  # a read, no copy-up
    assert engine.tiers.peek_cached_prefix(keys[:1] + [b"\0" * 16] + keys[2:]) == 1
    (again,) = llm.generate([target], GREEDY)
    assert again.num_cached_tokens == 64 and again.token_ids == first.token_ids
    engine.check_integrity()
    assert_pool_idle(engine)


def test_blocks_evicted_again_while_queued_are_copied_up_at_admission(model_dir, corpus_ids):
    """The target's blocks come up from T1 when it arrives, but it waits behind a long
    prompt whose blocks push them out of the 8-block pool again; they are copied up once
    more when the target is admitted, so it still hits every one."""
    llm = make_llm(
        model_dir("tiny-llama"), num_kv_blocks=8, max_num_seqs=1, host_kv_cache_bytes=8 << 20
    )
    engine = llm.engine
    target = corpus_ids[:70]
    [first] = llm.generate([target], GREEDY)
    llm.generate([corpus_ids[100:180]], GREEDY)  # 5 blocks: the target's go down to T1
    long = corpus_ids[200:300]  # 7 blocks: while it runs, nothing else fits
    [_, again] = llm.generate([long, target], GREEDY)
    engine.check_integrity()
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens == 64
    assert_pool_idle(engine)


def test_worker_metrics_count_host_tier_lookups():
    from prometheus_client import CollectorRegistry

    from rtp_serve.engine.host_tier import HostTierStats
    from rtp_serve.services.worker.metrics import WorkerFamilies, WorkerMetrics

    registry = CollectorRegistry()
    metrics = WorkerMetrics(WorkerFamilies(registry), "fused", "m")
    metrics.host_tier(None)  # no tier configured: nothing exported
    metrics.host_tier(HostTierStats(1000, 400, 2, hits=3, misses=1, stored=2, evicted=0))
    metrics.host_tier(HostTierStats(1000, 600, 3, hits=5, misses=2, stored=3, evicted=0))
    labels = {"role": "fused", "model_name": "m", "tier": "host"}
    assert registry.get_sample_value("rtp:prefix_cache_hits_total", labels) == 5
    assert registry.get_sample_value("rtp:prefix_cache_queries_total", labels) == 7
    used = {"role": "fused", "model_name": "m", "kind": "used"}
    assert registry.get_sample_value("rtp:host_kv_tier_bytes", used) == 600
