"""PD disaggregation inside the engine: one engine prefills and exports the prompt KV, a
second reserves blocks, takes the KV and the first token, and decodes on. The tokens must
equal a single engine's (and so HF's) greedy output."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncLLM, EngineConfig, SamplingParams
from engine.scheduler import NoCapacityError, SampledToken
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


def _decode_all(engine):
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            engine.check_integrity()
            if out.finished:
                final[out.request_id] = out
    return final


def test_prefill_export_then_decode_matches_single_engine(model_dir, prompts, hf_greedy):
    pre = make_llm(model_dir("tiny-llama")).engine
    dec = make_llm(model_dir("tiny-llama")).engine
    for i, prompt in enumerate(prompts[:4]):
        first = _prefill(pre, f"r{i}", prompt)
        assert first.prompt_kv is not None and first.prompt_kv.start == 0
        assert first.prompt_kv.k.shape[1] == len(prompt)
        req = dec.make_request(f"r{i}", prompt, GREEDY)
        assert dec.reserve(req) == 0
        dec.check_integrity()
        kv = first.prompt_kv
        dec.write_prompt_kv(f"r{i}", kv.start, kv.k, kv.v)
        out = dec.activate(f"r{i}", SampledToken(first.token_ids[0]))
        assert out.token_ids == first.token_ids
    final = _decode_all(dec)
    for i, prompt in enumerate(prompts[:4]):
        assert final[f"r{i}"].token_ids == hf_greedy("tiny-llama", prompt, 12)[0]
    assert_pool_idle(pre)
    assert_pool_idle(dec)


def test_decode_side_prefix_hit_skips_cached_blocks(model_dir, corpus_ids, hf_greedy):
    pre = make_llm(model_dir("tiny-llama")).engine
    dec = make_llm(model_dir("tiny-llama")).engine
    shared = corpus_ids[:48]
    a, b = shared + corpus_ids[100:110], shared + corpus_ids[120:127]
    for rid, prompt in (("a", a), ("b", b)):
        req = dec.make_request(rid, prompt, GREEDY)
        cached = dec.reserve(req)
        assert cached == (48 if rid == "b" else 0)
        first = _prefill(pre, rid, prompt, export_from=cached)
        assert first.prompt_kv.start == cached
        assert first.prompt_kv.k.shape[1] == len(prompt) - cached
        dec.write_prompt_kv(rid, cached, first.prompt_kv.k, first.prompt_kv.v)
        dec.activate(rid, SampledToken(first.token_ids[0]))
        final = _decode_all(dec)
        assert final[rid].token_ids == hf_greedy("tiny-llama", prompt, 12)[0]
    assert_pool_idle(dec)


def test_reservation_refused_when_full_and_freed_on_abort(model_dir, prompts):
    dec = make_llm(model_dir("tiny-llama"), num_kv_blocks=4).engine
    big = dec.make_request("big", prompts[7][:60], GREEDY)  # 4 blocks of 16
    dec.reserve(big)
    with pytest.raises(NoCapacityError):
        dec.reserve(dec.make_request("more", prompts[0], GREEDY))
    dec.check_integrity()
    dec.abort_request("big")
    assert_pool_idle(dec)


def test_async_pd_path(model_dir, prompts, hf_greedy):
    path = str(model_dir("tiny-llama"))
    pre = AsyncLLM(EngineConfig(model=path, num_kv_blocks=64))
    dec = AsyncLLM(EngineConfig(model=path, num_kv_blocks=64))
    poison_kv(pre.engine)
    poison_kv(dec.engine)

    async def one(i, prompt):
        rid = f"p{i}"
        cached = await dec.reserve(rid, prompt, GREEDY)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        outs = [
            o async for o in pre.generate(prompt, params, request_id=rid, export_kv_from=cached)
        ]
        first = outs[-1]
        tokens = []
        async for out in dec.generate_prefilled(
            rid, [first.prompt_kv], SampledToken(first.token_ids[0])
        ):
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
