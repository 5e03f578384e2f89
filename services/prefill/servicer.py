"""The prefill worker's Prefill RPC: compute a prompt, stream its first token at once, then
the prompt's KV blocks (those the decode side does not already cache)."""

from __future__ import annotations

import dataclasses
import logging

import grpc

from engine.async_llm import AsyncLLM
from services.common.block_hash import block_hash_keys
from services.common.convert import logprob_to_pb, params_from_pb
from services.common.kv_wire import split_blocks
from services.common.pb import worker_pb2
from services.common.worker import StatsServicer, abort_status

log = logging.getLogger(__name__)


class PrefillServicer(StatsServicer):
    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.block_size = llm.engine.config.block_size

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        prompt = list(request.prompt_token_ids)
        try:
            params = params_from_pb(request.params)
            # Only the first token is sampled here; the decode side applies every stop rule.
            first_params = dataclasses.replace(
                params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
            )
            skip = request.skip_blocks * self.block_size
            if skip >= len(prompt):
                raise ValueError(f"skip_blocks {request.skip_blocks} covers the whole prompt")
            final = None
            async for out in self.llm.generate(
                prompt, first_params, request.request_id, request.priority, export_kv_from=skip
            ):
                final = out
        except (ValueError, RuntimeError) as exc:
            code, message = abort_status(exc)
            await context.abort(code, message)
        assert final is not None and final.prompt_kv is not None
        token = final.token_ids[0]
        logprobs = []
        if final.logprobs:
            lp = final.logprobs[0]
            logprobs.append(logprob_to_pb(lp.token_id, lp.logprob, lp.top))
        yield worker_pb2.PrefillResponse(
            first=worker_pb2.GenerateResponse(
                token_ids=[token],
                logprobs=logprobs,
                num_prompt_tokens=len(prompt),
                num_cached_tokens=final.num_cached_tokens,
            )
        )
        hashes = block_hash_keys(prompt, self.block_size, self.llm.engine.hash_extra)
        kv = final.prompt_kv
        for block in split_blocks(kv.k, kv.v, kv.start, self.block_size, hashes):
            yield worker_pb2.PrefillResponse(block=block)
