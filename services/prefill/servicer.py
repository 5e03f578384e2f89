"""The prefill worker's Prefill RPC: compute a prompt, stream its first token at once, then
the prompt's KV blocks (those the decode side does not already cache).

The prompt's prefix is resolved through the tiers first (services/worker/tiers.py), and the
full blocks computed here are written back to the remote tier.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from rtp_serve.core.block_hash import BlockHash, block_hash_keys, verify_first_key
from rtp_serve.services.cache.client import CacheClient
from rtp_serve.services.common import tracing
from rtp_serve.services.common.convert import logprob_to_pb, params_from_pb, tenant_from_pb
from rtp_serve.services.common.kv_block_size import payload_nbytes
from rtp_serve.services.common.metrics import SENT
from rtp_serve.services.common.naming import NameClient
from rtp_serve.services.common.pb import nameservice_pb2, worker_pb2
from rtp_serve.services.worker import metrics
from rtp_serve.services.worker.drain import drained
from rtp_serve.services.worker.kv_wire import split_blocks
from rtp_serve.services.worker.servicer import WorkerServicer, abort
from rtp_serve.services.worker.tiers import TierHits, Tiers, remote_blocks

if TYPE_CHECKING:
    from rtp_serve.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


class PrefillServicer(WorkerServicer):
    def __init__(
        self, llm: AsyncLLM, cache: CacheClient | None, remote_write: str = "reused"
    ) -> None:
        super().__init__(llm)
        self.block_size = llm.block_size
        self.metrics = metrics.worker(nameservice_pb2.ROLE_PREFILL, llm.model)
        self.tiers = Tiers(llm, cache, self.metrics, remote_write)

    async def background(self, names: NameClient | None) -> None:
        await self.tiers.follow(names)

    @drained
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        prompt = list(request.prompt_token_ids)
        trace.get_current_span().set_attribute(tracing.REQUEST_ID, request.request_id)
        try:
            hashes = self._prompt_keys(prompt, list(request.block_hashes), request.lora_name)
            params = params_from_pb(request.params, request.structured)
            # Only the first token is sampled here (under the request's grammar, if any); the
            # decode side applies every stop rule and advances its own grammar past it.
            first_params = dataclasses.replace(
                params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
            )
            skip = request.skip_blocks * self.block_size
            if skip >= len(prompt):
                raise ValueError(f"skip_blocks {request.skip_blocks} covers the whole prompt")
            fetch = self.tiers.prefetch(prompt, hashes, remote_blocks(request))
            final = None
            with tracing.tracer.start_as_current_span("prefill") as span:
                async for out in self.llm.generate(
                    prompt,
                    first_params,
                    request.request_id,
                    request.priority,
                    export_kv_from=skip,
                    block_hashes=hashes,
                    lora=request.lora_name,
                    tenant=tenant_from_pb(request.tenant),
                    prefetch=fetch,
                ):
                    final = out
                    fetch.admitted(out.num_cached_tokens)
                hits = fetch.hits
                _trace_prefill(span, len(prompt), hits, final)
        except (ValueError, LookupError, RuntimeError) as exc:
            await abort(context, exc)
        assert final is not None and final.prompt_kv is not None
        logprobs = [logprob_to_pb(lp) for lp in final.new_logprobs or []]
        yield worker_pb2.PrefillResponse(
            first=worker_pb2.GenerateResponse(
                token_ids=final.new_token_ids,
                logprobs=logprobs,
                num_prompt_tokens=len(prompt),
                num_cached_tokens=final.num_cached_tokens,
                queue_s=final.queue_s or 0.0,
                prefill_s=final.prefill_s or 0.0,
            )
        )
        blocks = split_blocks(final.prompt_kv, self.block_size, hashes)
        with self.metrics.transferring(SENT):
            for block in blocks:
                self.metrics.kv_transfer(SENT, payload_nbytes(block))
                yield worker_pb2.PrefillResponse(block=block)
        log.debug(
            "prefill %s: %d device + %d remote blocks",
            request.request_id,
            hits.device,
            hits.remote,
            extra={"request_id": request.request_id},
        )
        _trace_kv_sent(trace.get_current_span(), blocks)
        if self.tiers.writes_back():
            self.tiers.write_back(blocks, hits, final.num_cached_tokens // self.block_size)

    def _prompt_keys(self, prompt: list[int], given: list[BlockHash], lora: str) -> list[BlockHash]:
        """The decode worker's keys for this prompt after a cheap check, else our own."""
        salt = self.llm.salt_for(lora)  # UnknownAdapterError: NOT_FOUND
        if not given:
            return block_hash_keys(prompt, self.block_size, salt)
        if not verify_first_key(given, prompt, self.block_size, salt):
            raise ValueError(
                "block_hashes do not match this worker's (another model, KV dtype, block size "
                "or LoRA adapter?)"
            )
        return given


def _trace_prefill(span: trace.Span, num_prompt_tokens: int, hits: TierHits, final) -> None:
    if span.is_recording() and final is not None:
        span.set_attributes(
            {
                "rtp.prefill.blocks_device": hits.device,
                "rtp.prefill.blocks_remote": hits.remote,
                "rtp.prefill.tokens_cached": final.num_cached_tokens,
                "rtp.prefill.tokens_computed": num_prompt_tokens - final.num_cached_tokens,
            }
        )


def _trace_kv_sent(span: trace.Span, blocks: list) -> None:
    if span.is_recording():
        nbytes = sum(len(b.k) + len(b.v) for b in blocks)
        span.set_attributes({"rtp.kv.blocks_sent": len(blocks), "rtp.kv.bytes_sent": nbytes})
