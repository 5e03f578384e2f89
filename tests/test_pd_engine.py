"""PD disaggregation inside the engine: one engine prefills and exports the prompt KV, a
second admits a remote-prefill request (blocks reserved, WAITING_FOR_REMOTE_KV), takes the
KV and the first token, and decodes on. The tokens must equal a single engine's (and so
HF's) greedy output."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rtp_serve.core.outputs import SampledToken
from rtp_serve.engine import AsyncLLM, EngineConfig, SamplingParams
from rtp_serve.engine.outputs import OutputCollector, PromptKV
from rtp_serve.engine.request import RequestStatus
from tests.helpers import assert_pool_idle, make_llm, poison_kv

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prefill(engine, request_id, prompt, export_from=0):
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(engine.make_request(request_id, prompt, params, export_kv_from=export_from))
    while True:
        for out in engine.step():
            engine.check_integrity()
            if out.finished:
                return out


def _reserve(engine, request_id, prompt, collectors=None) -> int:
    """Admit a remote-prefill request (one step; other requests' outputs go to their
    collectors); returns the prompt tokens cached here."""
    request = engine.make_request(request_id, prompt, GREEDY, remote_prefill=True)
    engine.add_request(request)
    outs = {o.request_id: o for o in engine.step()}
    engine.check_integrity()
    out = outs.pop(request_id)
    for other in outs.values():
        collectors[other.request_id].add(other)
    assert out.waiting_for_kv and not out.new_token_ids
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    return out.num_cached_tokens


def _decode_all(engine, collectors):
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            engine.check_integrity()
            collectors[out.request_id].add(out)
            if out.finished:
                final[out.request_id] = collectors[out.request_id].result()
    return final


def _expected(model_dir, hf_greedy, kv_dtype):
    """Greedy tokens of one engine of this KV dtype: HF's for full-precision KV."""
    if kv_dtype == "auto":
        return lambda prompt: hf_greedy("tiny-llama", prompt, 12)[0]
    single = make_llm(model_dir("tiny-llama"), kv_dtype=kv_dtype)
    return lambda prompt: single.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_prefill_export_then_decode_matches_single_engine(model_dir, prompts, hf_greedy, kv_dtype):
    """The prompt's KV moves as stored (an int8 cache's blocks with their scales), so the
    decode engine continues exactly as the prefilling one would have."""
    pre = make_llm(model_dir("tiny-llama"), kv_dtype=kv_dtype).engine
    dec = make_llm(model_dir("tiny-llama"), kv_dtype=kv_dtype).engine
    expected = _expected(model_dir, hf_greedy, kv_dtype)
    collectors = {}
    for i, prompt in enumerate(prompts[:4]):
        first = _prefill(pre, f"r{i}", prompt)
        assert first.prompt_kv is not None and first.prompt_kv.start == 0
        assert first.prompt_kv.k.shape[1] == len(prompt)
        assert _reserve(dec, f"r{i}", prompt, collectors) == 0
        out = dec.write_remote_kv(f"r{i}", [first.prompt_kv], SampledToken(first.new_token_ids[0]))
        assert out.new_token_ids == first.new_token_ids
        collectors[f"r{i}"] = OutputCollector(f"r{i}", prompt)
        collectors[f"r{i}"].add(out)
    final = _decode_all(dec, collectors)
    for i, prompt in enumerate(prompts[:4]):
        assert final[f"r{i}"].token_ids == expected(prompt)
    assert_pool_idle(pre)
    assert_pool_idle(dec)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_decode_side_prefix_hit_skips_cached_blocks(model_dir, corpus_ids, hf_greedy, kv_dtype):
    pre = make_llm(model_dir("tiny-llama"), kv_dtype=kv_dtype).engine
    dec = make_llm(model_dir("tiny-llama"), kv_dtype=kv_dtype).engine
    expected = _expected(model_dir, hf_greedy, kv_dtype)
    shared = corpus_ids[:48]
    a, b = shared + corpus_ids[100:110], shared + corpus_ids[120:127]
    for rid, prompt in (("a", a), ("b", b)):
        cached = _reserve(dec, rid, prompt)
        assert cached == (48 if rid == "b" else 0)
        first = _prefill(pre, rid, prompt, export_from=cached)
        assert first.prompt_kv.start == cached
        assert first.prompt_kv.k.shape[1] == len(prompt) - cached
        collectors = {rid: OutputCollector(rid, prompt)}
        out = dec.write_remote_kv(rid, [first.prompt_kv], SampledToken(first.new_token_ids[0]))
        collectors[rid].add(out)
        final = _decode_all(dec, collectors)
        assert final[rid].token_ids == expected(prompt)
    assert_pool_idle(dec)


def test_reservation_waits_when_full_and_is_freed_on_abort(model_dir, prompts):
    dec = make_llm(model_dir("tiny-llama"), num_kv_blocks=4).engine
    assert _reserve(dec, "big", prompts[7][:60]) == 0  # 4 blocks of 16
    more = dec.make_request("more", prompts[0], GREEDY, remote_prefill=True)
    dec.add_request(more)
    assert dec.step() == []  # no room: it queues instead of failing
    dec.check_integrity()
    assert more.status == RequestStatus.WAITING and not dec.has_schedulable_requests()
    with pytest.raises(ValueError, match="not waiting for remote KV"):
        dec.write_remote_kv("more", [], SampledToken(1))
    dec.abort_request("big")
    (out,) = dec.step()  # the freed blocks admit it
    assert out.request_id == "more" and out.waiting_for_kv
    dec.abort_request("more")
    assert_pool_idle(dec)


def test_remote_kv_must_cover_the_uncached_prompt(model_dir, prompts):
    pre = make_llm(model_dir("tiny-llama")).engine
    dec = make_llm(model_dir("tiny-llama")).engine
    prompt = prompts[2]
    _reserve(dec, "r", prompt)
    kv = _prefill(pre, "r", prompt).prompt_kv
    short = type(kv)(kv.start, kv.k[:, :-1], kv.v[:, :-1])
    with pytest.raises(ValueError, match="KV ends at position"):
        dec.write_remote_kv("r", [short], SampledToken(1))
    dec.check_integrity()
    dec.abort_request("r")
    assert_pool_idle(dec)


def test_preempted_pd_request_is_recomputed_here(model_dir, corpus_ids, hf_greedy):
    """Regression: a PD request preempted after its KV arrived was re-admitted as waiting for
    remote KV that never comes again, and hung. It must recompute locally instead."""
    pre = make_llm(model_dir("tiny-llama")).engine
    dec = make_llm(model_dir("tiny-llama"), num_kv_blocks=5).engine  # 80 tokens
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = {"a": corpus_ids[:30], "b": corpus_ids[40:70]}  # 2 blocks each; 50 tokens at end
    collectors = {}
    for rid, prompt in prompts.items():
        dec.add_request(dec.make_request(rid, prompt, long, remote_prefill=True))
        outs = {o.request_id: o for o in dec.step()}
        assert outs[rid].waiting_for_kv
        for other, o in outs.items():
            if other != rid:
                collectors[other].add(o)
        first = _prefill(pre, rid, prompt)
        collectors[rid] = OutputCollector(rid, prompt)
        kv = first.prompt_kv
        collectors[rid].add(dec.write_remote_kv(rid, [kv], SampledToken(first.new_token_ids[0])))
    steps = 0
    while dec.has_unfinished_requests():
        assert dec.has_schedulable_requests(), "a request waits for KV that will never come"
        for out in dec.step():
            dec.check_integrity()
            collectors[out.request_id].add(out)
        steps += 1
        assert steps < 500
    for rid, prompt in prompts.items():
        assert collectors[rid].result().token_ids == hf_greedy("tiny-llama", prompt, 20)[0]
    assert_pool_idle(dec)


def test_async_pd_path(model_dir, prompts, hf_greedy):
    path = str(model_dir("tiny-llama"))
    pre = AsyncLLM(EngineConfig(model=path, num_kv_blocks=64))
    dec = AsyncLLM(EngineConfig(model=path, num_kv_blocks=64))
    poison_kv(pre.engine)
    poison_kv(dec.engine)

    async def one(i, prompt):
        rid = f"p{i}"
        outputs = dec.generate(prompt, GREEDY, rid, remote_prefill=True)
        reserved = await anext(outputs)
        assert reserved.waiting_for_kv
        cached = reserved.num_cached_tokens
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        outs = [
            o async for o in pre.generate(prompt, params, request_id=rid, export_kv_from=cached)
        ]
        first = outs[-1]
        dec.deliver_kv(rid, [first.prompt_kv], SampledToken(first.new_token_ids[0]))
        tokens = []
        async for out in outputs:
            tokens.extend(out.new_token_ids)
        return tokens

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts[:3])))

    try:
        results = asyncio.run(main())
        for prompt, tokens in zip(prompts[:3], results, strict=True):
            assert tokens == hf_greedy("tiny-llama", prompt, 12)[0]
        assert asyncio.run(_idle(dec))
    finally:
        pre.shutdown()
        dec.shutdown()


async def _idle(llm: AsyncLLM) -> bool:
    def check(engine):
        engine.check_integrity()
        return engine.pool.num_free_blocks == engine.pool.num_blocks

    return await llm.call(check)


def test_int8_kv_without_its_scales_is_refused(model_dir, prompts):
    pre = make_llm(model_dir("tiny-llama"), kv_dtype="int8").engine
    dec = make_llm(model_dir("tiny-llama"), kv_dtype="int8").engine
    prompt = prompts[2]
    _reserve(dec, "r", prompt)
    kv = _prefill(pre, "r", prompt).prompt_kv
    assert kv.k.dtype == torch.int8 and kv.k_scale is not None
    assert kv.k_scale.shape == (kv.k.shape[0], -(-len(prompt) // 16), kv.k.shape[2])
    bare = PromptKV(kv.start, kv.k, kv.v)
    with pytest.raises(ValueError, match="without its scales"):
        dec.write_remote_kv("r", [bare], SampledToken(1))
    dec.abort_request("r")
    assert_pool_idle(dec)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_blocks_imported_from_a_tier_serve_like_computed_ones(model_dir, corpus_ids, kv_dtype):
    """Whole blocks read from one engine's pool (as a cache tier holds them) and imported
    into another's are prefix hits there, and the output is the first engine's."""
    from rtp_serve.core.block_hash import block_hash_keys

    src = make_llm(model_dir("tiny-llama"), kv_dtype=kv_dtype)
    dst = make_llm(model_dir("tiny-llama"), kv_dtype=kv_dtype)
    prompt = corpus_ids[:70]
    expected = src.generate([prompt], GREEDY)[0].token_ids
    engine = src.engine
    keys = block_hash_keys(prompt, 16, engine.cache_salt)  # 4 full blocks
    blocks = [engine.pool.get_cached(h).block_id for h in keys]
    kv = engine.runner.read_kv(blocks, 0, len(keys) * 16)  # (blocks need not be contiguous)
    assert dst.engine.tiers.import_blocks(keys, kv) == len(keys)
    dst.engine.check_integrity()
    out = dst.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 64
    assert out.token_ids == expected
    assert_pool_idle(dst.engine)
