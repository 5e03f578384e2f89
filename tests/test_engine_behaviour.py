"""Engine behaviour on tiny-llama: sampling, stop conditions, bad input, aborts, AsyncLLM.

References here are our own engine (greedy runs are checked against HF in test_parity.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from rtp_serve.engine import LLM, AsyncLLM, EngineConfig, SamplingParams
from rtp_serve.engine.outputs import OutputCollector
from rtp_serve.engine.request import RequestStatus
from tests.helpers import (
    assert_pool_idle,
    drive,
    engine_held,
    make_llm,
    poison_kv,
    step_checked,
    use_torch_attention,
)

PRESET = "tiny-llama"
VOCAB = 8192
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=123)


@pytest.fixture(scope="module")
def llama_dir(model_dir) -> Path:
    return model_dir(PRESET)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    """A shared engine for tests that leave it idle (each one checks that they do)."""
    return make_llm(llama_dir)


@pytest.fixture(scope="module")
def greedy_ref(llm, prompts) -> list[list[int]]:
    """Greedy continuations (16 tokens, EOS ignored) of every prompt."""
    return [out.token_ids for out in llm.generate(prompts, GREEDY)]


def first_new_token(tokens: list[int], start: int = 2) -> int:
    """Index of the first token at or after `start` that does not occur before it."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError(f"no fresh token in {tokens}")


# -- sampling ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "engine_args", [{}, {"max_num_batched_tokens": 16}], ids=["one", "chunked"]
)
def test_seeded_sampling_is_batch_invariant(engine_args, llama_dir, prompts):
    [alone] = make_llm(llama_dir).generate([prompts[2]], SEEDED)
    assert len(alone.token_ids) == 16
    mates = [
        SamplingParams(max_tokens=20, temperature=1.0),  # unseeded: the engine's generator
        SEEDED,
        SamplingParams(max_tokens=8, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=7),
    ]
    llm = make_llm(llama_dir, **engine_args)
    batch = llm.generate([prompts[5], prompts[2], prompts[7], prompts[0]], mates)
    assert batch[1].token_ids == alone.token_ids
    # Again on the same engine: now a prefix-cache hit, still the same draws.
    [again] = llm.generate([prompts[2]], SEEDED)
    assert again.num_cached_tokens == 16
    assert again.token_ids == alone.token_ids
    assert_pool_idle(llm.engine)


def test_different_seeds_differ(llm, prompts):
    params = [SEEDED, replace(SEEDED, seed=124), SEEDED]
    a, b, c = llm.generate([prompts[2]] * 3, params)
    assert a.token_ids == c.token_ids
    assert a.token_ids != b.token_ids
    assert_pool_idle(llm.engine)


def test_degenerate_sampling_equals_greedy(llm, prompts, greedy_ref):
    """top_k=1, or a top_p that keeps one token, reduce sampling to the argmax."""
    top1 = SamplingParams(max_tokens=16, temperature=1.0, top_k=1, ignore_eos=True)
    tiny_p = SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, ignore_eos=True, seed=1)
    a, b = llm.generate([prompts[4], prompts[4]], [top1, tiny_p])
    assert a.token_ids == b.token_ids == greedy_ref[4]
    assert_pool_idle(llm.engine)


# -- stop conditions -----------------------------------------------------------------------
def test_max_tokens_finishes_with_length(llm, prompts, greedy_ref):
    [out] = llm.generate([prompts[3]], SamplingParams(max_tokens=5, temperature=0.0))
    assert out.finish_reason == "length"
    assert out.token_ids == greedy_ref[3][:5]
    assert out.stop_reason is None


def test_stop_token_ids_stop(llm, prompts, greedy_ref):
    ref = greedy_ref[6]
    k = first_new_token(ref)
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[ref[k], 7777])
    [out] = llm.generate([prompts[6]], params)
    assert out.finish_reason == "stop"
    assert out.stop_reason == ref[k]
    assert out.token_ids == ref[: k + 1]  # the stop token is the last output token
    assert_pool_idle(llm.engine)


def test_min_tokens_defers_stop_token(llm, prompts, greedy_ref):
    ref = greedy_ref[1]
    stop = ref[0]  # greedy would stop at once
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop], min_tokens=6)
    [out] = llm.generate([prompts[1]], params)
    assert len(out.token_ids) >= 6
    assert stop not in out.token_ids[:6]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop and out.stop_reason == stop
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 16
    [early] = llm.generate(
        [prompts[1]], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop])
    )
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    assert_pool_idle(llm.engine)


def _with_eos(src: Path, dst: Path, eos: list[int]) -> Path:
    """A copy of a checkpoint (symlinked) whose generation_config declares other EOS ids."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (dst / f.name).symlink_to(f)
    gen = {"bos_token_id": 0, "eos_token_id": eos, "pad_token_id": 0}
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def test_eos_from_generation_config(llama_dir, prompts, greedy_ref, tmp_path):
    assert make_llm(llama_dir).engine.model_config.eos_token_ids == (2, 0)
    ref = greedy_ref[5]
    k = first_new_token(ref)
    eos_llm = make_llm(_with_eos(llama_dir, tmp_path / "eos", [ref[k]]))
    stop, ignore, late = eos_llm.generate(
        [prompts[5]] * 3,
        [
            SamplingParams(max_tokens=16, temperature=0.0),
            SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=0.0, min_tokens=k + 2),
        ],
    )
    assert stop.token_ids == ref[: k + 1]
    assert stop.finish_reason == "stop"
    assert stop.stop_reason is None  # EOS, not a caller's stop token
    assert ignore.token_ids == ref and ignore.finish_reason == "length"
    assert ref[k] not in late.token_ids[: k + 2]
    assert late.token_ids[:k] == ref[:k]
    assert_pool_idle(eos_llm.engine)


def test_context_limit_finishes_with_length(llama_dir, prompts):
    llm = make_llm(llama_dir, max_model_len=64)
    [out] = llm.generate([prompts[6]], SamplingParams(max_tokens=20, temperature=0.0))
    assert len(prompts[6]) == 58
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 64 - 58
    assert_pool_idle(llm.engine)


def test_context_is_capped_by_kv_pool(llama_dir, prompts):
    """A request never needs more blocks than the pool holds (else it would wait forever)."""
    llm = make_llm(llama_dir, num_kv_blocks=2)  # 32 tokens of KV
    assert llm.engine.limits.max_model_len == 32
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([prompts[5]], GREEDY)
    [a, b] = llm.generate([prompts[2], prompts[3]], SamplingParams(max_tokens=30, temperature=0.0))
    assert (a.finish_reason, len(a.token_ids)) == ("length", 32 - 17)
    assert (b.finish_reason, len(b.token_ids)) == ("length", 32 - 24)
    assert_pool_idle(llm.engine)


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], GREEDY, "prompt"),
        ("", GREEDY, "prompt"),
        (list(range(1, 65)), GREEDY, "prompt"),  # == max_model_len: no room for output
        (list(range(1, 90)), GREEDY, "prompt"),
        ([5, VOCAB], GREEDY, "token ids"),
        ([5, -1], GREEDY, "token ids"),
        ([5, 6.0], GREEDY, "token ids"),
        ([5, 6], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
    ],
    ids=["empty", "empty-text", "at-limit", "over-limit", "id>=vocab", "id<0", "float", "stop"],
)
def test_bad_prompt_rejected(prompt, params, match, llama_dir):
    llm = make_llm(llama_dir, max_model_len=64)
    with pytest.raises(ValueError, match=match):
        llm.engine.make_request("x", prompt, params)
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params)
    assert_pool_idle(llm.engine)


def test_one_bad_prompt_queues_nothing(llm, prompts, greedy_ref):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([prompts[0], [1, 2, VOCAB + 5], prompts[1]], GREEDY)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([prompts[0], prompts[1]], [GREEDY])
    assert llm.engine.scheduler.num_waiting == 0
    assert_pool_idle(llm.engine)
    # The engine is still usable, and nothing of the failed call leaks into this one.
    outs = llm.generate([prompts[0], prompts[1]], GREEDY)
    assert [o.token_ids for o in outs] == greedy_ref[:2]
    assert_pool_idle(llm.engine)


# -- aborts --------------------------------------------------------------------------------
def test_abort_waiting_prefilling_and_decoding(llama_dir, prompts, greedy_ref):
    engine = make_llm(llama_dir, max_num_batched_tokens=16, max_num_seqs=3).engine
    a, b, c, d = (
        engine.make_request(name, prompts[i], GREEDY)
        for name, i in [("a", 7), ("b", 2), ("c", 0), ("d", 3)]
    )
    for r in (a, b, c, d):
        engine.add_request(r)
    step_checked(engine)
    assert d.status == RequestStatus.WAITING
    assert engine.abort_request("d").finish_reason == "abort"
    engine.check_integrity()

    step_checked(engine)
    assert a.status == RequestStatus.RUNNING and 0 < a.num_computed_tokens < 70
    out = engine.abort_request("a")  # mid-prefill
    assert (out.finished, out.finish_reason, out.new_token_ids) == (True, "abort", [])
    assert a.output_token_ids == []
    engine.check_integrity()

    for _ in range(50):
        if b.num_output_tokens >= 2:
            break
        step_checked(engine)
    assert b.status == RequestStatus.RUNNING and b.num_output_tokens >= 2
    out = engine.abort_request("b")  # mid-decode
    assert out.finish_reason == "abort"
    assert b.output_token_ids == greedy_ref[2][: len(b.output_token_ids)]
    engine.check_integrity()

    final, _ = drive(engine, {})
    assert set(final) == {"c"}
    assert final["c"].token_ids == greedy_ref[0]
    assert engine.abort_request("c") is None  # finished
    assert engine.abort_request("a") is None  # already aborted
    assert engine.abort_request("nope") is None
    assert_pool_idle(engine)


def test_abort_request_sharing_prefix_blocks(llama_dir, corpus_ids):
    shared = corpus_ids[10:60]
    pa, pb = shared + corpus_ids[150:156], shared + corpus_ids[170:178]
    [ref_b] = make_llm(llama_dir).generate([pb], GREEDY)
    engine = make_llm(llama_dir).engine
    a = engine.make_request("a", pa, GREEDY)
    b = engine.make_request("b", pb, GREEDY)
    engine.add_request(a)
    engine.add_request(b)
    for _ in range(3):
        step_checked(engine)
    assert b.num_cached_tokens == 48
    assert any(blk.ref_cnt == 2 for blk in engine.pool.blocks)  # shared prefix blocks
    engine.abort_request("a")
    engine.check_integrity()
    final, _ = drive(engine, {})
    assert final["b"].token_ids == ref_b.token_ids
    assert_pool_idle(engine)


@pytest.mark.parametrize("backend", ["default", "torch"])
def test_uninitialised_kv_memory_is_harmless(backend, llama_dir, prompts, greedy_ref):
    llm = LLM(str(llama_dir), block_size=16, num_kv_blocks=64)
    if backend == "torch":
        use_torch_attention(llm.engine)
    llm.engine.runner.kv_cache.fill_(float("nan"))  # what torch.empty may hand out
    outs = llm.generate([prompts[0], prompts[3]], GREEDY)
    assert [o.token_ids for o in outs] == [greedy_ref[0], greedy_ref[3]]


# -- AsyncLLM ------------------------------------------------------------------------------
def test_an_itl_target_chunks_a_prompt_while_another_decodes(llm, llama_dir, prompts, greedy_ref):
    # A target so small that no prompt token fits under it: every chunk is the efficient
    # floor less the decode row. The decoding request gets its token every step, the prompt
    # comes in chunks, and both give the tokens they give without a target.
    engine = make_llm(llama_dir, itl_target_ms=1e-3).engine
    engine.runner.efficient_rows = 24  # the floor, as if measured so here
    for p in range(1, 65):  # a step cost known to be positive in every term
        engine.costs.observe_step(0.002 + 1e-4 * p + 5e-5 * (p % 7), p, p % 7)
    long = prompts[7] + prompts[6]  # 128 tokens
    [long_ref] = [out.token_ids for out in llm.generate([long], GREEDY)]
    a = engine.make_request("a", prompts[0], GREEDY)
    engine.add_request(a)
    assert engine.prompt_cap() is None  # nobody decodes: the budget alone
    step_checked(engine)
    assert a.num_output_tokens == 1
    b = engine.make_request("b", long, GREEDY)
    engine.add_request(b)
    steps = 0
    while b.num_output_tokens == 0:
        cap = engine.prompt_cap()
        assert cap == 24 - 1
        made, computed = a.num_output_tokens, b.num_computed_tokens
        step_checked(engine)
        assert a.num_output_tokens == made + 1
        assert b.num_computed_tokens - computed <= cap
        steps += 1
    assert steps == -(-len(long) // 23)
    drive(engine, {})
    assert a.output_token_ids == greedy_ref[0] and b.output_token_ids == long_ref
    assert_pool_idle(engine)


def test_an_itl_target_chunks_the_wait_a_worker_predicts(llama_dir, prompts):
    # Under the target, the step cost a worker reports (Stats, load reports: the master
    # predicts waits from it) has the chunk a step takes beside the requests running now
    # as its token budget, so that a queued prompt's wait is counted in those chunks.
    llm = _async_llm(llama_dir, itl_target_ms=1e-3, max_num_batched_tokens=256)
    llm.engine.runner.efficient_rows = 24  # the floor, as if measured so here
    for p in range(1, 65):  # a step cost known to be positive in every term
        llm.engine.costs.observe_step(0.002 + 1e-4 * p + 5e-5 * (p % 7), p, p % 7)
    try:
        idle = llm.step_cost()
        assert idle.token_budget == 256  # nobody runs: the budget alone

        async def main() -> list[int]:
            budgets = []
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            async for out in llm.generate(prompts[0], params):
                # From the second output on, the running count read includes this request
                # (the stats after its first step are set before its second step runs).
                if out.num_output_tokens >= 2 and not out.finished:
                    budgets.append(llm.step_cost().token_budget)
            return budgets

        running = asyncio.run(main())
        assert running and all(b == 24 - 1 for b in running), running
    finally:
        llm.shutdown()


def _async_llm(llama_dir: Path, **engine_args) -> AsyncLLM:
    args = {"block_size": 16, "num_kv_blocks": 64} | engine_args
    llm = AsyncLLM(EngineConfig(model=str(llama_dir), **args))
    poison_kv(llm.engine)  # the engine thread is idle until the first request
    return llm


async def _collect(llm: AsyncLLM, prompt, params, request_id=None):
    """(the whole output joined from the deltas, the streamed token ids)"""
    streamed, last = [], None
    collector = OutputCollector(request_id or "", [])
    async for out in llm.generate(prompt, params, request_id=request_id):
        assert not (last and last.finished), "output after the final one"
        streamed.extend(out.new_token_ids)
        collector.add(out)
        last = out
    return collector.result(), streamed


async def _idle_state(llm: AsyncLLM) -> tuple[bool, int, int]:
    def probe(engine):
        engine.check_integrity()
        return (
            engine.has_unfinished_requests(),
            engine.pool.num_free_blocks,
            engine.pool.num_blocks,
        )

    return await llm.call(probe)


def test_async_concurrent_matches_offline(llama_dir, prompts, greedy_ref):
    chosen = [prompts[i] for i in (0, 2, 5, 7)] + [prompts[2]]
    params = [GREEDY] * 4 + [SEEDED]
    [seeded] = make_llm(llama_dir).generate([prompts[2]], SEEDED)
    expected = [greedy_ref[i] for i in (0, 2, 5, 7)] + [seeded.token_ids]

    llm = _async_llm(llama_dir, max_num_batched_tokens=32)
    try:

        async def main():
            results = await asyncio.gather(
                *(_collect(llm, p, sp) for p, sp in zip(chosen, params, strict=True))
            )
            return results, await _idle_state(llm)

        results, (busy, free, total) = asyncio.run(main())
    finally:
        llm.shutdown()
    for (final, streamed), want in zip(results, expected, strict=True):
        assert final.finished and final.finish_reason == "length"
        assert final.token_ids == want
        assert streamed == final.token_ids
    assert not busy and free == total


def test_async_close_iterator_aborts(llama_dir, prompts, greedy_ref):
    llm = _async_llm(llama_dir)
    try:

        async def main():
            long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
            agen = llm.generate(prompts[7], long, request_id="long")
            seen = 0
            async with contextlib.aclosing(agen):
                async for out in agen:
                    seen += 1
                    assert not out.finished
                    if seen == 3:
                        break  # aclosing() closes the generator, which aborts the request
            other = await _collect(llm, prompts[1], GREEDY)
            return other, await _idle_state(llm)

        (final, streamed), (busy, free, total) = asyncio.run(main())
    finally:
        llm.shutdown()
    assert final.token_ids == streamed == greedy_ref[1]
    assert not busy and free == total


def test_async_bad_input_and_duplicate_id(llama_dir, prompts, greedy_ref):
    llm = _async_llm(llama_dir)
    try:

        async def main():
            with pytest.raises(ValueError, match="prompt"):
                await anext(aiter(llm.generate([], GREEDY)))
            with pytest.raises(ValueError, match="top_p"):
                SamplingParams(top_p=2.0)
            # Same id while the first is running: the second is refused, the first unharmed.
            first = asyncio.create_task(_collect(llm, prompts[3], GREEDY, request_id="dup"))
            await asyncio.sleep(0)  # let the first submit
            with pytest.raises(ValueError, match="already in use"):
                await _collect(llm, prompts[4], GREEDY, request_id="dup")
            return await first, await _idle_state(llm)

        (final, streamed), (busy, free, total) = asyncio.run(main())
    finally:
        llm.shutdown()
    assert final.finish_reason == "length"
    assert final.token_ids == streamed == greedy_ref[3]
    assert not busy and free == total


def test_async_shutdown_fails_pending(llama_dir, prompts):
    llm = _async_llm(llama_dir)

    async def main():
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        agen = llm.generate(prompts[7], long)
        async with contextlib.aclosing(agen):
            await anext(agen)
            llm.shutdown()
            with pytest.raises(RuntimeError, match="shut down"):
                async for _ in agen:
                    pass

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert not llm.engine.has_unfinished_requests()
    assert_pool_idle(llm.engine)


def test_async_deltas_concatenate_to_the_offline_output(llama_dir, prompts):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    [offline] = make_llm(llama_dir).generate([prompts[5]], params)
    llm = _async_llm(llama_dir)
    try:

        async def main():
            return [out async for out in llm.generate(prompts[5], params)]

        deltas = asyncio.run(main())
    finally:
        llm.shutdown()
    # Each delta carries only its own new token and logprobs, never the sequence so far.
    assert all(len(d.new_token_ids) == 1 == len(d.new_logprobs) for d in deltas)
    assert [t for d in deltas for t in d.new_token_ids] == offline.token_ids
    assert [lp for d in deltas for lp in d.new_logprobs] == offline.logprobs
    assert [d.num_output_tokens for d in deltas] == list(range(1, 11))
    assert [d.finished for d in deltas] == [False] * 9 + [True]


def test_a_cancelled_call_is_skipped_and_the_engine_lives_on(llama_dir, prompts, greedy_ref):
    """A caller cancelled while its call waits for the engine thread (a timed-out RPC, a
    shutdown) must not stop that thread: the call is skipped, later work is served."""
    llm = _async_llm(llama_dir)
    ran: list[str] = []
    try:

        async def main():
            async with engine_held(llm):
                cancelled = asyncio.ensure_future(llm.call(lambda engine: ran.append("late")))
                await asyncio.sleep(0)  # (it is in the engine's inbox)
                cancelled.cancel()  # queued behind the blocker: cancelled before it runs
                with pytest.raises(asyncio.CancelledError):
                    await cancelled  # once it is, so is the engine-side future it waited on
            # (a dead engine thread would never answer: fail instead of hanging)
            result, _ = await asyncio.wait_for(_collect(llm, prompts[0], GREEDY), 60)
            return result

        result = asyncio.run(main())
        assert ran == [] and result.token_ids == greedy_ref[0]
    finally:
        llm.shutdown()


def test_stats_count_requests_the_busy_engine_has_not_taken(llama_dir, prompts, greedy_ref):
    """What reaches a worker during a step waits for that step to end: the load the master
    routes by (stats) counts it as waiting from the moment it is sent, not from when the
    engine takes it; and the first output splits its time to first token (queue, prefill)."""
    llm = _async_llm(llama_dir)
    try:

        async def main():
            async with engine_held(llm):  # a long step, as it were
                before = llm.stats()
                run = asyncio.ensure_future(_first_and_all(llm, prompts[0]))
                await asyncio.sleep(0.05)  # (sent: in the engine's inbox)
                during = llm.stats()
            first, result = await asyncio.wait_for(run, 60)
            await llm.call(lambda engine: None)  # (the snapshot after its last step is taken)
            return before, during, llm.stats(), first, result

        before, during, after, first, result = asyncio.run(main())
        assert (before.num_waiting, before.num_queued_tokens) == (0, 0)
        assert (during.num_waiting, during.num_queued_tokens) == (1, len(prompts[0]))
        assert (after.num_waiting, after.num_queued_tokens) == (0, 0)
        assert result.token_ids == greedy_ref[0]
        assert first.queue_s >= 0.05 and first.prefill_s > 0  # it waited behind the blocker
    finally:
        llm.shutdown()


async def _first_and_all(llm: AsyncLLM, prompt):
    """(the first output with a token, the whole output): later outputs carry no split."""
    first, collector = None, OutputCollector("", [])
    async for out in llm.generate(prompt, GREEDY):
        collector.add(out)
        if first is None and out.new_token_ids:
            first = out
        else:
            assert out.queue_s is None and out.prefill_s is None
    return first, collector.result()


# -- tenants -------------------------------------------------------------------------------
def test_tenants_take_turns_and_outputs_stay_the_same(llama_dir, prompts):
    """One slot, a heavy tenant's four requests queued before a light tenant's one: fair
    scheduling (engine/fair_queue.py) admits the light one second, first come first served
    last; each request's greedy tokens are the same either way."""
    from rtp_serve.core.tenant import TenantShare

    heavy, light = TenantShare("heavy"), TenantShare("light", weight=0.5)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    orders, tokens = {}, {}
    for fair in (True, False):
        engine = make_llm(llama_dir, max_num_seqs=1, fair_scheduling=fair).engine
        for i in range(4):
            engine.add_request(engine.make_request(f"h{i}", prompts[i], params, tenant=heavy))
        engine.add_request(engine.make_request("l0", prompts[4], params, tenant=light))
        order, out = [], {}
        while engine.has_unfinished_requests():
            for delta in step_checked(engine):
                out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                if delta.finished:
                    order.append(delta.request_id)
        orders[fair], tokens[fair] = order, out
        assert_pool_idle(engine)
    assert orders == {True: ["h0", "l0", "h1", "h2", "h3"], False: ["h0", "h1", "h2", "h3", "l0"]}
    assert tokens[True] == tokens[False]
