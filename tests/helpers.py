"""Plain helpers shared by the engine tests (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from rtp_serve.engine.async_llm import AsyncLLM
from rtp_serve.engine.llm import LLM
from rtp_serve.engine.llm_engine import LLMEngine
from rtp_serve.engine.outputs import CompletionOutput, OutputCollector, RequestOutput
from rtp_serve.engine.request import Request
from rtp_serve.kernels.attention import AttentionMetadata, PrefillChunk

PRESETS = ("tiny-llama", "tiny-qwen2", "tiny-mistral")
# Greedy references are computed once for this many tokens; tests compare prefixes of them.
REF_TOKENS = 24


def assert_pool_idle(engine: LLMEngine) -> None:
    """Integrity holds and every block is free (or cached but unreferenced)."""
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def step_checked(engine: LLMEngine) -> list[RequestOutput]:
    outputs = engine.step()
    engine.check_integrity()
    return outputs


def drive(
    engine: LLMEngine,
    arrivals: Mapping[int, Sequence[Request]],
    max_steps: int = 2000,
) -> tuple[dict[str, CompletionOutput], dict[str, list[int]]]:
    """Add `arrivals[i]` before step i, step (checking integrity) until all finish.

    Returns (whole output per request id, joined from its deltas; streamed new_token_ids
    concatenated per id).
    """
    final: dict[str, CompletionOutput] = {}
    streamed: dict[str, list[int]] = {}
    # Requests already in the engine keep the tokens they have so far.
    collectors = {
        rid: OutputCollector(rid, r.prompt_token_ids, list(r.output_token_ids))
        for rid, r in engine.scheduler.requests.items()
    }
    last_arrival = max(arrivals, default=0)
    for i in range(max_steps):
        for request in arrivals.get(i, ()):
            engine.add_request(request)
            collectors[request.request_id] = OutputCollector(
                request.request_id, request.prompt_token_ids
            )
        if i >= last_arrival and not engine.has_unfinished_requests():
            return final, streamed
        for out in step_checked(engine):
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            collector = collectors[out.request_id]
            collector.add(out)
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = collector.result()
    raise AssertionError(f"engine made no progress to completion in {max_steps} steps")


# Finite junk, not NaN: masked-out attention slots then contribute exactly 0, while any read
# of a slot that was never written (a stale prefix-cache hit, a wrong block table) derails
# the output deterministically instead of depending on what the allocator left there.
KV_POISON = 1e4


def make_llm(model_dir: Path, dtype: str = "float32", **engine_args) -> LLM:
    """An LLM on a small pool (block_size 16, 64 blocks unless given) with a poisoned cache."""
    args = {"block_size": 16, "num_kv_blocks": 64} | engine_args
    llm = LLM(str(model_dir), dtype=dtype, **args)
    poison_kv(llm.engine)
    return llm


def prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """float32 logits of every position of one prompt, run as one fresh prefill into blocks
    0, 1, ... of the pool (which must hold them)."""
    runner, n, bs = llm.engine.runner, len(ids), llm.engine.config.block_size
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_size=bs,
        num_decodes=0,
        prefills=[PrefillChunk(0, n, 0, torch.arange(-(-n // bs)))],
    )
    with torch.inference_mode():
        return runner.model.forward(
            torch.tensor(ids), torch.arange(n), runner.kv_caches, meta, torch.arange(n)
        )


def poison_kv(engine: LLMEngine) -> None:
    runner = engine.runner
    if runner.kv_scales is None:
        runner.kv_cache.fill_(KV_POISON)
    else:  # int8: -128 is never written (rows clamp to +-127); a stale scale reads huge
        runner.kv_cache.fill_(-128)
        runner.kv_scales.fill_(KV_POISON)


def use_torch_attention(engine: LLMEngine) -> None:
    """Swap in the torch reference attention backend (used where no CPU kernel builds)."""
    from rtp_serve.kernels.attention import TorchAttention

    model = engine.runner.model
    model.attention = TorchAttention(model.attention.scale)


@contextlib.asynccontextmanager
async def engine_held(llm: AsyncLLM):
    """The engine thread held inside a call (busy, as in a long step) until the block ends:
    what is sent meanwhile waits in its inbox, to be taken all at once."""
    inside, gate = threading.Event(), threading.Event()

    def block(engine) -> None:
        inside.set()
        gate.wait(10)

    blocker = asyncio.ensure_future(llm.call(block))
    assert await asyncio.to_thread(inside.wait, 10)  # the engine thread is blocked
    try:
        yield
    finally:
        gate.set()
        await blocker


def linear_case(m: int, k: int, n: int):
    """x [m, k], w [n, k] (scaled so outputs stay near 1), bias [n] and residual [m, n]."""
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    return x, w, torch.randn(n, generator=g), torch.randn(m, n, generator=g)
