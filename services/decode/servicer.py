"""The token stream of a request: the Generate RPC of decode and fused workers.

Fused (no prefill_address): the local engine runs prefill and decode, the prompt's prefix
resolved through the tiers first and its computed blocks written back (worker/tiers.py).
PD: reserve KV blocks here (the request waits for remote KV as a scheduler state), ask the
prefill worker to fill them, forward its first token to the caller at once, hand the
received KV to the engine, and decode on.
Whatever ends the call (finish, error, the caller going away) releases the request's blocks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from rtp_serve.core.block_hash import BlockHash, block_hash_keys, verify_first_key
from rtp_serve.core.cost_model import TIER_TRANSFER
from rtp_serve.core.outputs import SampledToken
from rtp_serve.engine.kv_export import KVExport
from rtp_serve.engine.outputs import RequestOutput
from rtp_serve.services.cache.client import CacheClient
from rtp_serve.services.common import grpc_util, tracing
from rtp_serve.services.common.convert import (
    logprob_from_pb,
    logprob_to_pb,
    params_from_pb,
    tenant_from_pb,
)
from rtp_serve.services.common.kv_block_size import payload_nbytes
from rtp_serve.services.common.metrics import RECEIVED
from rtp_serve.services.common.naming import NameClient
from rtp_serve.services.common.pb import nameservice_pb2, worker_pb2, worker_pb2_grpc
from rtp_serve.services.worker import metrics, streams
from rtp_serve.services.worker.drain import drained
from rtp_serve.services.worker.kv_wire import join_blocks
from rtp_serve.services.worker.servicer import PeerUnavailableError, WorkerServicer, abort
from rtp_serve.services.worker.tiers import Tiers, remote_blocks

if TYPE_CHECKING:
    from rtp_serve.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


def _response(out: RequestOutput) -> worker_pb2.GenerateResponse:
    msg = worker_pb2.GenerateResponse(
        token_ids=out.new_token_ids,
        logprobs=[logprob_to_pb(lp) for lp in out.new_logprobs or []],
        finished=out.finished,
        finish_reason=out.finish_reason or "",
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )
    if out.stop_reason is not None:
        msg.stop_reason = out.stop_reason
    if out.queue_s is not None:
        msg.queue_s, msg.prefill_s = out.queue_s, out.prefill_s or 0.0
    return msg


class DecodeServicer(WorkerServicer):
    serves_streams = True

    def __init__(
        self,
        llm: AsyncLLM,
        allow_fused: bool,
        role: int = nameservice_pb2.ROLE_DECODE,
        cache: CacheClient | None = None,
        remote_write: str = "reused",
    ) -> None:
        super().__init__(llm)
        self.allow_fused = allow_fused
        self.block_size = llm.block_size
        self._channels = grpc_util.ChannelCache()
        self._warned_salt = False
        self.metrics = metrics.worker(role, llm.model)
        self.tiers = Tiers(llm, cache, self.metrics, remote_write)

    async def background(self, names: NameClient | None) -> None:
        await self.tiers.follow(names)

    @drained
    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        prompt = list(request.prompt_token_ids)
        trace.get_current_span().set_attribute(tracing.REQUEST_ID, request.request_id)
        try:
            params = params_from_pb(request.params, request.structured)
            hashes = self._prompt_keys(prompt, list(request.block_hashes), request.lora_name)
        except (ValueError, LookupError) as exc:
            await abort(context, exc)
        if request.prefill_address:
            stream = self._pd(request, prompt, params, hashes, context)
        elif self.allow_fused:
            stream = self._fused(request, prompt, params, hashes)
        else:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "a decode worker needs prefill_address"
            )
        try:
            async for msg in stream:
                yield msg
        except (ValueError, LookupError, RuntimeError) as exc:
            await abort(context, exc)

    async def Streams(self, request_iterator, context: grpc.aio.ServicerContext):
        """Generate for many requests of one caller, each step's messages as one reply."""
        async for reply in streams.serve(self.Generate, request_iterator, context):
            yield reply

    def _prompt_keys(self, prompt: list[int], given: list[BlockHash], lora: str) -> list[BlockHash]:
        """The frontend's keys (hashed there once, from the namespace the workers
        registered; the engine and the prefill worker reuse them) after a cheap check of the
        first; our own where none came or the check fails."""
        salt = self.llm.salt_for(lora)  # UnknownAdapterError: NOT_FOUND
        if given and verify_first_key(given, prompt, self.block_size, salt):
            return given
        if given:
            self._salt_mismatch()
        return block_hash_keys(prompt, self.block_size, salt)

    def _salt_mismatch(self) -> None:
        # Only routing suffers (the master's index never matches this worker's keys): serve
        # the request with our own keys, and say so once.
        if not self._warned_salt:
            self._warned_salt = True
            log.warning(
                "the caller's block_hashes differ from this worker's: the frontend hashed "
                "with another worker's KV namespace (model, KV dtype or block size), so "
                "cache-aware routing cannot match this worker's prefix cache"
            )

    async def _fused(self, request, prompt, params, hashes: list[BlockHash]):
        fetch = self.tiers.prefetch(prompt, hashes, remote_blocks(request))
        # With a remote tier (and room to spare), the KV of the prompt blocks the write
        # policy may write back comes with the last output (Tiers.export: the blocks are
        # intact until the engine's next step).
        export_from, part = self.tiers.export(hashes) or (None, KVExport.PROMPT)
        async for out in self.llm.generate(
            prompt,
            params,
            request.request_id,
            request.priority,
            block_hashes=hashes,
            export_kv_from=export_from,
            export_kv=part,
            lora=request.lora_name,
            tenant=tenant_from_pb(request.tenant),
            prefetch=fetch,
        ):
            fetch.admitted(out.num_cached_tokens)
            if out.prompt_kv is not None:
                reused = out.num_cached_tokens // self.block_size
                self.tiers.write_back_kv(out.prompt_kv, hashes, fetch.hits, reused)
            yield _response(out)

    async def _pd(self, request, prompt, params, hashes: list[BlockHash], context):
        """Reserve blocks here (queued like any request until they fit), have the prefill
        worker fill them, forward its first token at once, then decode on."""
        rid = request.request_id
        outputs = self.llm.generate(
            prompt,
            params,
            rid,
            request.priority,
            remote_prefill=True,
            block_hashes=hashes,
            lora=request.lora_name,
            tenant=tenant_from_pb(request.tenant),
        )
        call = None
        spans: list[trace.Span] = []  # kv_transfer, decode: ended however the call ends
        transfer = contextlib.ExitStack()  # the KV transfer under way, in the metrics
        try:
            reserved = await anext(outputs)
            assert reserved.waiting_for_kv
            cached = reserved.num_cached_tokens
            stub = worker_pb2_grpc.WorkerStub(self._channels.get(request.prefill_address))
            call = stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    params=request.params,
                    priority=request.priority,
                    skip_blocks=cached // self.block_size,
                    block_hashes=hashes,
                    structured=request.structured if request.HasField("structured") else None,
                    lora_name=request.lora_name,
                    tenant=request.tenant,
                    remote_blocks=remote_blocks(request),
                ),
                timeout=context.time_remaining(),
            )
            first: worker_pb2.GenerateResponse | None = None
            blocks = []
            async for msg in grpc_util.responses(call):
                if msg.HasField("first"):
                    first = msg.first
                    spans.append(tracing.tracer.start_span("kv_transfer"))  # blocks follow
                    transfer.enter_context(self.metrics.transferring(RECEIVED))
                    transfer_started = time.perf_counter()
                    # The caller sees the first token before any KV has moved.
                    yield worker_pb2.GenerateResponse(
                        token_ids=first.token_ids,
                        logprobs=first.logprobs,
                        num_prompt_tokens=len(prompt),
                        num_cached_tokens=first.num_cached_tokens,
                        queue_s=first.queue_s,
                        prefill_s=first.prefill_s,
                    )
                else:
                    self.metrics.kv_transfer(RECEIVED, payload_nbytes(msg.block))
                    blocks.append(msg.block)
            transfer.close()
            if first is None or not first.token_ids:
                raise PeerUnavailableError(
                    "prefill worker sent no first token", request.prefill_address
                )
            layout = self.llm.kv_layout
            kv = join_blocks(blocks, cached, len(prompt), self.block_size, hashes, layout)
            _end_kv_transfer(spans[0], blocks)
            # The master weighs decode candidates by this (services/master/cost.py).
            seconds = time.perf_counter() - transfer_started
            self.llm.costs.observe_fetch(TIER_TRANSFER, seconds, kv.nbytes)
            lp = logprob_from_pb(first.logprobs[0]) if first.logprobs else None
            self.llm.deliver_kv(rid, [kv], SampledToken(first.token_ids[0], lp))
            spans.append(decode := tracing.tracer.start_span("decode"))
            seen_first = False
            async for out in outputs:
                decode.set_attribute("rtp.decode.tokens_generated", out.num_output_tokens)
                msg = _response(out)
                if not seen_first:
                    seen_first = True  # the first token went out already
                    if not out.finished:
                        continue
                    del msg.token_ids[:]
                    del msg.logprobs[:]
                    msg.ClearField("queue_s")  # the first token's split went out with it
                    msg.ClearField("prefill_s")
                # The prompt's cache hit is the prefill side's, not this worker's.
                msg.num_cached_tokens = first.num_cached_tokens
                yield msg
        except grpc.aio.AioRpcError as exc:
            raise PeerUnavailableError(
                f"prefill worker {request.prefill_address} failed: {exc.code().name} "
                f"{exc.details()}",
                request.prefill_address,
            ) from exc
        finally:
            transfer.close()
            for span in spans:
                if span.is_recording():  # not ended yet
                    span.end()
            if call is not None:
                grpc_util.cancel(call)
            await outputs.aclose()  # aborts the request here unless it finished


def _end_kv_transfer(span: trace.Span, blocks: list) -> None:
    if span.is_recording():
        nbytes = sum(len(b.k) + len(b.v) for b in blocks)
        span.set_attributes(
            {"rtp.kv.blocks_received": len(blocks), "rtp.kv.bytes_received": nbytes}
        )
        span.end()
