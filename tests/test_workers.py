"""Worker processes over real gRPC: fused Generate, and PD (decode asks prefill for KV)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import grpc
import pytest

from rtp_serve.engine import SamplingParams
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.convert import params_to_pb
from rtp_serve.services.common.pb import worker_pb2, worker_pb2_grpc
from tests.procs import SMALL_WORKER, grpc_service, worker_roles

WORKER_FLAGS = SMALL_WORKER
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def workers(model_dir):
    with worker_roles(str(model_dir("tiny-llama"))) as addresses:
        yield addresses


async def _generate(
    address: str, prompt, params, prefill: str = "", rid: str = "r", block_hashes=()
):
    async with grpc_util.channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        request = worker_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            params=params_to_pb(params),
            prefill_address=prefill,
            block_hashes=block_hashes,
        )
        return [msg async for msg in stub.Generate(request, timeout=30)]


async def _stats(address: str) -> worker_pb2.WorkerStats:
    async with grpc_util.channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).Stats(
            worker_pb2.WorkerStatsRequest(), timeout=10
        )


async def _until(address: str, ready, timeout: float = 10.0) -> None:
    """Poll Stats until `ready(stats)` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not ready(await _stats(address)):
        assert loop.time() < deadline, "the worker never reached the expected state"
        await asyncio.sleep(0.02)


def _tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_fused_and_pd_match_hf(workers, prompts, hf_greedy):
    async def main():
        fused = await asyncio.gather(
            *(_generate(workers["fused"], p, GREEDY, rid=f"f{i}") for i, p in enumerate(prompts))
        )
        pd = await asyncio.gather(
            *(
                _generate(workers["decode"], p, GREEDY, workers["prefill"], rid=f"p{i}")
                for i, p in enumerate(prompts)
            )
        )
        return fused, pd

    fused, pd = asyncio.run(main())
    for prompt, f, p in zip(prompts, fused, pd, strict=True):
        expected = hf_greedy("tiny-llama", prompt, 10)[0]
        assert _tokens(f) == expected
        assert _tokens(p) == expected
        assert f[-1].finished and p[-1].finished and p[-1].finish_reason == "length"
        assert p[0].token_ids == expected[:1]  # the first token arrives on its own, first
    for name in ("fused", "prefill", "decode"):
        stats = asyncio.run(_stats(workers[name]))
        assert stats.integrity_ok, stats.integrity_error
        assert stats.held_blocks == 0


def test_pd_repeated_prompt_reports_cached_tokens(workers, corpus_ids):
    prompt = corpus_ids[:70]
    first = asyncio.run(_generate(workers["decode"], prompt, GREEDY, workers["prefill"], rid="c1"))
    again = asyncio.run(_generate(workers["decode"], prompt, GREEDY, workers["prefill"], rid="c2"))
    assert _tokens(first) == _tokens(again)
    assert first[-1].num_cached_tokens == 0
    assert again[-1].num_cached_tokens == 64


def test_pd_max_tokens_one_finishes_with_first_token(workers, prompts):
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    msgs = asyncio.run(_generate(workers["decode"], prompts[2], one, workers["prefill"], rid="one"))
    assert len(_tokens(msgs)) == 1 and msgs[-1].finished and msgs[-1].finish_reason == "length"
    assert asyncio.run(_stats(workers["decode"])).held_blocks == 0


def test_bad_input_is_invalid_argument_and_cancel_frees_blocks(workers, prompts):
    bad = worker_pb2.GenerateRequest(request_id="bad", prompt_token_ids=[10**6])
    bad.params.max_tokens = 4

    async def call_bad(address):
        async with grpc_util.channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in worker_pb2_grpc.WorkerStub(ch).Generate(bad, timeout=10):
                    pass
            return err.value.code()

    assert asyncio.run(call_bad(workers["fused"])) == grpc.StatusCode.INVALID_ARGUMENT

    async def cancel_midway(address, prefill):
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        async with grpc_util.channel(address) as ch:
            request = worker_pb2.GenerateRequest(
                request_id="cancel",
                prompt_token_ids=prompts[4],
                params=params_to_pb(long),
                prefill_address=prefill,
            )
            call = worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=30)
            seen = 0
            async for msg in call:
                seen += len(msg.token_ids)
                if seen >= 3:
                    call.cancel()
                    break
        for _ in range(100):  # the worker notices the cancellation asynchronously
            stats = await _stats(address)
            if stats.held_blocks == 0 and stats.num_running == 0:
                return stats
            await asyncio.sleep(0.05)
        return stats

    for address, prefill in ((workers["fused"], ""), (workers["decode"], workers["prefill"])):
        stats = asyncio.run(cancel_midway(address, prefill))
        assert stats.held_blocks == 0 and stats.integrity_ok


def test_non_finite_sampling_floats_are_invalid_argument(workers, prompts):
    """A raw Worker.Generate with inf/NaN proto floats (the frontend refuses them too, but a
    worker is a gRPC service of its own): INVALID_ARGUMENT naming the field, fused and PD."""

    async def call(address: str, field: str, value: float) -> grpc.aio.AioRpcError:
        request = worker_pb2.GenerateRequest(
            request_id=f"bad-{field}", prompt_token_ids=prompts[0], params=params_to_pb(GREEDY)
        )
        if field == "logit_bias":
            request.params.logit_bias[3] = value
        else:
            setattr(request.params, field, value)
        async with grpc_util.channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=10):
                    pass
        return err.value

    cases = [("temperature", float("inf")), ("top_p", float("nan")), ("logit_bias", -math.inf)]
    for role in ("fused", "decode"):
        for field, value in cases:
            exc = asyncio.run(call(workers[role], field, value))
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (role, field, exc)
            assert field in exc.details() and "finite" in exc.details(), exc.details()
    assert asyncio.run(_stats(workers["decode"])).held_blocks == 0


def test_seeded_sampling_is_the_same_fused_and_pd(workers, prompts):
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)

    async def main():
        fused = await _generate(workers["fused"], prompts[5], seeded, rid="s-f")
        pd = await _generate(workers["decode"], prompts[5], seeded, workers["prefill"], rid="s-p")
        return _tokens(fused), _tokens(pd)

    fused, pd = asyncio.run(main())
    assert fused == pd and len(fused) == 10


def test_callers_block_hashes_right_or_wrong_serve_the_same(workers, model_dir, prompts, hf_greedy):
    """Keys from a caller with the right salt are taken; keys with another salt (a frontend
    configured for another model) only cost routing, never the request."""
    from rtp_serve.core.block_hash import block_hash_keys, cache_salt

    prompt = prompts[7]  # several full blocks
    right = block_hash_keys(prompt, 16, cache_salt(model_dir("tiny-llama"), "float32"))
    wrong = block_hash_keys(prompt, 16, cache_salt(model_dir("tiny-llama"), "bfloat16"))
    assert right and right != wrong
    expected = hf_greedy("tiny-llama", prompt, 10)[0]

    async def main():
        out = []
        for i, keys in enumerate((right, wrong)):
            out.append(
                await _generate(workers["fused"], prompt, GREEDY, rid=f"h{i}", block_hashes=keys)
            )
            out.append(
                await _generate(
                    workers["decode"], prompt, GREEDY, workers["prefill"], f"hp{i}", keys
                )
            )
        return out

    for msgs in asyncio.run(main()):
        assert _tokens(msgs) == expected


def test_prefill_refuses_keys_of_another_salt(workers, model_dir, prompts):
    from rtp_serve.core.block_hash import block_hash_keys, cache_salt

    prompt = prompts[7]
    wrong = block_hash_keys(prompt, 16, cache_salt(model_dir("tiny-llama"), "bfloat16"))

    async def main():
        async with grpc_util.channel(workers["prefill"]) as ch:
            call = worker_pb2_grpc.WorkerStub(ch).Prefill(
                worker_pb2.PrefillRequest(
                    request_id="bad-keys",
                    prompt_token_ids=prompt,
                    params=params_to_pb(GREEDY),
                    block_hashes=wrong,
                ),
                timeout=30,
            )
            return [m async for m in call]

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(main())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block_hashes" in info.value.details()


def test_full_waiting_queue_is_resource_exhausted(model_dir, prompts):
    """One running, one waiting, the next refused at once (the caller may go elsewhere);
    the running and the waiting one are still served."""
    model = str(model_dir("tiny-llama"))
    flags = ("--model", model, *WORKER_FLAGS, "--max-num-seqs", "1", "--max-num-waiting", "1")
    long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)  # seconds

    async def main(address):
        first = asyncio.create_task(_generate(address, prompts[0], long, rid="running"))
        await _until(address, lambda st: st.num_running == 1)
        second = asyncio.create_task(_generate(address, prompts[1], GREEDY, rid="waiting"))
        await _until(address, lambda st: st.num_waiting == 1)  # queued behind it
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(address, prompts[2], GREEDY, rid="refused")
        return info.value, await first, await second, await _stats(address)

    with grpc_service("fused", *flags) as (address, _):
        refused, first, second, stats = asyncio.run(main(address))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_num_waiting" in refused.details()
    assert first[-1].finished and len(_tokens(first)) == 1500
    assert second[-1].finished and len(_tokens(second)) == 10
    assert stats.integrity_ok and stats.held_blocks == 0


def test_int8_kv_pd_serves_what_fused_does(model_dir, prompts):
    """--kv-dtype int8 on every worker: blocks cross from prefill to decode with their
    scales, so PD greedy text equals fused text token for token."""
    flags = ("--model", str(model_dir("tiny-llama")), *WORKER_FLAGS, "--kv-dtype", "int8")
    with (
        grpc_service("fused", *flags) as (fused, _),
        grpc_service("prefill", *flags) as (prefill, _),
        grpc_service("decode", *flags) as (decode, _),
    ):

        async def main():
            picked = prompts[:4]
            f = await asyncio.gather(
                *(_generate(fused, p, GREEDY, rid=f"f{i}") for i, p in enumerate(picked))
            )
            p = await asyncio.gather(
                *(_generate(decode, p, GREEDY, prefill, rid=f"p{i}") for i, p in enumerate(picked))
            )
            return f, p, await _stats(decode)

        f, p, stats = asyncio.run(main())
    assert stats.kv_dtype == "int8"
    for a, b in zip(f, p, strict=True):
        assert _tokens(a) == _tokens(b) and len(_tokens(a)) == 10


def test_speculating_workers_serve_what_hf_does(model_dir, prompts, hf_greedy):
    """--speculative ngram on the fused and the decode worker (in PD mode the decode worker
    speculates): greedy output equals HF's; requests whose advice is right mostly accept."""
    model = str(model_dir("tiny-llama"))
    flags = ("--model", model, *WORKER_FLAGS)
    spec = ("--speculative", "ngram", "--num-speculative-tokens", "4")
    with (
        grpc_service("fused", *flags, *spec) as (fused, _),
        grpc_service("prefill", *flags) as (prefill, _),
        grpc_service("decode", *flags, *spec) as (decode, _),
    ):
        picked = prompts[:4]
        expected = [hf_greedy("tiny-llama", p, 10)[0] for p in picked]
        params = [replace(GREEDY, speculative_advice=tuple(e)) for e in expected]

        async def main():
            f = await asyncio.gather(
                *(
                    _generate(fused, p, sp, rid=f"f{i}")
                    for i, (p, sp) in enumerate(zip(picked, params, strict=True))
                )
            )
            d = await asyncio.gather(
                *(
                    _generate(decode, p, sp, prefill, rid=f"p{i}")
                    for i, (p, sp) in enumerate(zip(picked, params, strict=True))
                )
            )
            return f, d, await _stats(fused), await _stats(decode)

        f, d, fused_stats, decode_stats = asyncio.run(main())
    assert [_tokens(m) for m in f] == expected
    assert [_tokens(m) for m in d] == expected
    assert any(len(m.token_ids) > 1 for msgs in f + d for m in msgs)  # drafts were accepted
    for stats in (fused_stats, decode_stats):
        assert stats.integrity_ok, stats.integrity_error
        assert stats.held_blocks == 0


def test_tenants_travel_to_the_scheduler_and_bad_weights_are_refused(workers, prompts):
    """A tenant on Worker.Generate reaches the scheduler fused and through PD (the same
    greedy tokens as without one); a weight that is negative or not finite is
    INVALID_ARGUMENT naming `tenant`."""

    async def call(address: str, prefill: str, tenant: worker_pb2.Tenant):
        request = worker_pb2.GenerateRequest(
            request_id=f"t-{tenant.name}-{tenant.weight}",
            prompt_token_ids=prompts[1],
            params=params_to_pb(GREEDY),
            prefill_address=prefill,
            tenant=tenant,
        )
        async with grpc_util.channel(address) as ch:
            return [m async for m in worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=30)]

    plain = _tokens(asyncio.run(_generate(workers["fused"], prompts[1], GREEDY, rid="plain")))
    for address, prefill in ((workers["fused"], ""), (workers["decode"], workers["prefill"])):
        msgs = asyncio.run(call(address, prefill, worker_pb2.Tenant(name="acme", weight=2.5)))
        assert _tokens(msgs) == plain
        for weight in (-1.0, math.nan, math.inf):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                asyncio.run(call(address, prefill, worker_pb2.Tenant(name="acme", weight=weight)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "tenant" in err.value.details(), err.value.details()
    assert asyncio.run(_stats(workers["decode"])).held_blocks == 0
