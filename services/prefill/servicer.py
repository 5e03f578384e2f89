"""The prefill worker's Prefill RPC: compute a prompt, stream its first token at once, then
the prompt's KV blocks (those the decode side does not already cache).

Each prompt block is resolved through the tiers first (Algorithm 1 of the paper): found in
the device pool, it is reused; else found in the remote tier (cache service, backed by
Redis), it is fetched and imported into the pool; else it is computed. Full blocks computed
here are written back to the remote tier off the request path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
from opentelemetry import trace

from engine.async_llm import AsyncLLM
from engine.block_hash import BlockHash, block_hash_keys, verify_first_key
from services.cache.client import CacheClient
from services.common import tracing
from services.common.convert import logprob_to_pb, params_from_pb
from services.common.metrics import SENT
from services.common.naming import MemberSet, NameClient
from services.common.pb import nameservice_pb2, worker_pb2
from services.worker import metrics
from services.worker.drain import drained
from services.worker.kv_wire import join_blocks, split_blocks
from services.worker.servicer import WorkerServicer, abort_status

log = logging.getLogger(__name__)
MAX_PENDING_PUTS = 16


@dataclasses.dataclass(frozen=True, slots=True)
class TierHits:
    device: int  # leading blocks found in the device pool
    remote: int  # further blocks fetched from the cache service


class PrefillServicer(WorkerServicer):
    def __init__(self, llm: AsyncLLM, cache: CacheClient | None) -> None:
        super().__init__(llm)
        self.cache = cache
        self.block_size = llm.block_size
        self._puts: set[asyncio.Task] = set()
        self.metrics = metrics.worker(nameservice_pb2.ROLE_PREFILL, llm.model)

    async def background(self, names: NameClient | None) -> None:
        """Follow the cache service instances in the nameservice."""
        if names is None or self.cache is None:
            return
        members = MemberSet()
        async for event in names.watch():
            members.apply(event)
            if event.member.role == nameservice_pb2.ROLE_CACHE:
                caches = members.with_role(nameservice_pb2.ROLE_CACHE)
                self.cache.set_addresses([m.address for m in caches])

    @drained
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        prompt = list(request.prompt_token_ids)
        trace.get_current_span().set_attribute(tracing.REQUEST_ID, request.request_id)
        try:
            hashes = self._prompt_keys(prompt, list(request.block_hashes))
            params = params_from_pb(request.params)
            # Only the first token is sampled here; the decode side applies every stop rule.
            first_params = dataclasses.replace(
                params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
            )
            skip = request.skip_blocks * self.block_size
            if skip >= len(prompt):
                raise ValueError(f"skip_blocks {request.skip_blocks} covers the whole prompt")
            hits = await self._resolve(prompt, hashes)
            self._count_hits(len(prompt), hits)
            final = None
            with tracing.tracer.start_as_current_span("prefill") as span:
                async for out in self.llm.generate(
                    prompt,
                    first_params,
                    request.request_id,
                    request.priority,
                    export_kv_from=skip,
                    block_hashes=hashes,
                ):
                    final = out
                _trace_prefill(span, len(prompt), hits, final)
        except (ValueError, RuntimeError) as exc:
            code, message = abort_status(exc)
            await context.abort(code, message)
        assert final is not None and final.prompt_kv is not None
        logprobs = [logprob_to_pb(lp) for lp in final.new_logprobs or []]
        yield worker_pb2.PrefillResponse(
            first=worker_pb2.GenerateResponse(
                token_ids=final.new_token_ids,
                logprobs=logprobs,
                num_prompt_tokens=len(prompt),
                num_cached_tokens=final.num_cached_tokens,
            )
        )
        blocks = split_blocks(final.prompt_kv, self.block_size, hashes)
        for block in blocks:
            self.metrics.kv_transfer(SENT, block.ByteSize())
            yield worker_pb2.PrefillResponse(block=block)
        log.debug(
            "prefill %s: %d device + %d remote blocks",
            request.request_id,
            hits.device,
            hits.remote,
            extra={"request_id": request.request_id},
        )
        _trace_kv_sent(trace.get_current_span(), blocks)
        self._write_back(
            [b for b in blocks if b.block_hash and b.index >= hits.device + hits.remote]
        )

    def _prompt_keys(self, prompt: list[int], given: list[BlockHash]) -> list[BlockHash]:
        """The decode worker's keys for this prompt after a cheap check, else our own."""
        if not given:
            return block_hash_keys(prompt, self.block_size, self.llm.cache_salt)
        if not verify_first_key(given, prompt, self.block_size, self.llm.cache_salt):
            raise ValueError(
                "block_hashes do not match this worker's (another model, KV dtype or block size?)"
            )
        return given

    async def _resolve(self, prompt: list[int], hashes: list[BlockHash]) -> TierHits:
        # At least one prompt token is always computed: its logits give the first token.
        usable = hashes[: (len(prompt) - 1) // self.block_size]
        device = await self.llm.num_cached_prefix(usable)
        if self.cache is None or device == len(usable):
            return TierHits(device, 0)
        found = await self.cache.get_prefix(usable[device:])
        if not found:
            return TierHits(device, 0)
        bs = self.block_size
        end = device + len(found)
        try:
            kv = join_blocks(found, device * bs, end * bs, bs, hashes, self.llm.kv_layout)
        except ValueError as exc:  # a bad remote block is a miss, not a failed request
            log.warning("ignoring remote KV blocks: %s", exc)
            return TierHits(device, 0)
        imported = usable[device:end]
        await self.llm.import_blocks(imported, kv)
        return TierHits(device, len(found))

    def _count_hits(self, num_prompt_tokens: int, hits: TierHits) -> None:
        usable = (num_prompt_tokens - 1) // self.block_size  # as _resolve looks them up
        remote = usable - hits.device if self.cache is not None else 0
        self.metrics.prefix_cache(usable, hits.device, remote, hits.remote)

    def _write_back(self, blocks: list) -> None:
        if self.cache is None or not blocks or len(self._puts) >= MAX_PENDING_PUTS:
            return
        task = asyncio.create_task(self.cache.put(blocks))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)


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
