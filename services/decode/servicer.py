"""The token stream of a request: the Generate RPC of decode and fused workers.

Fused (no prefill_address): the local engine runs prefill and decode.
PD: reserve KV blocks here, ask the prefill worker to fill them, forward its first token to
the caller at once, write the received KV into the reserved blocks, and decode on.
Whatever ends the call (finish, error, the caller going away) releases the request's blocks.
"""

from __future__ import annotations

import logging

import grpc
from opentelemetry import trace

from engine.async_llm import AsyncLLM
from engine.outputs import PromptKV, RequestOutput
from engine.request import TokenLogprobs
from engine.scheduler import SampledToken
from services.common import grpc_util, metrics, tracing
from services.common.block_hash import block_hash_keys
from services.common.convert import logprob_to_pb, params_from_pb
from services.common.kv_wire import join_blocks
from services.common.pb import nameservice_pb2, worker_pb2, worker_pb2_grpc
from services.common.worker import PeerUnavailableError, StatsServicer, abort_status

log = logging.getLogger(__name__)


def _response(out: RequestOutput, new_logprobs: list[TokenLogprobs]) -> worker_pb2.GenerateResponse:
    msg = worker_pb2.GenerateResponse(
        token_ids=out.new_token_ids,
        logprobs=[logprob_to_pb(lp.token_id, lp.logprob, lp.top) for lp in new_logprobs],
        finished=out.finished,
        finish_reason=out.finish_reason or "",
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
    )
    if out.stop_reason is not None:
        msg.stop_reason = out.stop_reason
    return msg


def _new_logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    if not out.logprobs:
        return []
    return out.logprobs[len(out.logprobs) - len(out.new_token_ids) :]


class DecodeServicer(StatsServicer):
    def __init__(
        self, llm: AsyncLLM, allow_fused: bool, role: int = nameservice_pb2.ROLE_DECODE
    ) -> None:
        self.llm = llm
        self.allow_fused = allow_fused
        self.block_size = llm.engine.config.block_size
        cfg = llm.engine.model_config
        self.kv_shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.metrics = metrics.worker(role, llm.engine.config.model)

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        prompt = list(request.prompt_token_ids)
        trace.get_current_span().set_attribute(tracing.REQUEST_ID, request.request_id)
        try:
            params = params_from_pb(request.params)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.prefill_address:
            stream = self._pd(request, prompt, params, context)
        elif self.allow_fused:
            stream = self._fused(request, prompt, params)
        else:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "a decode worker needs prefill_address"
            )
        try:
            async for msg in stream:
                yield msg
        except (ValueError, RuntimeError) as exc:
            code, message = abort_status(exc)
            await context.abort(code, message)

    async def _fused(self, request, prompt, params):
        first = True
        async for out in self.llm.generate(prompt, params, request.request_id, request.priority):
            if first:  # the prompt's prefix-cache hit is known once it has been computed
                first = False
                usable = (len(prompt) - 1) // self.block_size  # the engine's lookup limit
                self.metrics.prefix_cache(usable, out.num_cached_tokens // self.block_size)
            yield _response(out, _new_logprobs(out))

    async def _pd(self, request, prompt, params, context):
        rid = request.request_id
        cached = await self.llm.reserve(rid, prompt, params, request.priority)
        activated = False
        call = None
        spans: list[trace.Span] = []  # kv_transfer, decode: ended however the call ends
        try:
            stub = worker_pb2_grpc.WorkerStub(self._channel(request.prefill_address))
            call = stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    params=request.params,
                    priority=request.priority,
                    skip_blocks=cached // self.block_size,
                ),
                timeout=context.time_remaining(),
            )
            first: worker_pb2.GenerateResponse | None = None
            blocks = []
            async for msg in call:
                if msg.HasField("first"):
                    first = msg.first
                    spans.append(tracing.tracer.start_span("kv_transfer"))  # blocks follow
                    # The caller sees the first token before any KV has moved.
                    yield worker_pb2.GenerateResponse(
                        token_ids=first.token_ids,
                        logprobs=first.logprobs,
                        num_prompt_tokens=len(prompt),
                        num_cached_tokens=first.num_cached_tokens,
                    )
                else:
                    self.metrics.kv_transfer(metrics.RECEIVED, msg.block.ByteSize())
                    blocks.append(msg.block)
            if first is None:
                raise PeerUnavailableError("prefill worker sent no first token")
            hashes = block_hash_keys(prompt, self.block_size, self.llm.engine.hash_extra)
            k, v = join_blocks(blocks, cached, len(prompt), self.block_size, hashes, self.kv_shape)
            _end_kv_transfer(spans[0], blocks)
            lp = first.logprobs[0] if first.logprobs else None
            token = SampledToken(
                first.token_ids[0],
                TokenLogprobs(lp.token_id, lp.logprob, {t.token_id: t.logprob for t in lp.top})
                if lp
                else None,
            )
            activated = True
            seen_first = False
            spans.append(decode := tracing.tracer.start_span("decode"))
            async for out in self.llm.generate_prefilled(rid, [PromptKV(cached, k, v)], token):
                decode.set_attribute("rtp.decode.tokens_generated", len(out.token_ids))
                if not seen_first:
                    seen_first = True  # the first token went out already
                    if not out.finished:
                        continue
                    msg = _response(out, [])
                    del msg.token_ids[:]
                else:
                    msg = _response(out, _new_logprobs(out))
                # The prompt's cache hit is the prefill side's, not this worker's.
                msg.num_cached_tokens = first.num_cached_tokens
                yield msg
        except grpc.aio.AioRpcError as exc:
            raise PeerUnavailableError(
                f"prefill worker {request.prefill_address} failed: {exc.code().name} {exc.details()}"
            ) from exc
        finally:
            for span in spans:
                if span.is_recording():  # not ended yet
                    span.end()
            if call is not None:
                call.cancel()
            if not activated:
                self.llm.abort(rid)

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc_util.channel(address)
        return ch


def _end_kv_transfer(span: trace.Span, blocks: list) -> None:
    if span.is_recording():
        nbytes = sum(len(b.k) + len(b.v) for b in blocks)
        span.set_attributes(
            {"rtp.kv.blocks_received": len(blocks), "rtp.kv.bytes_received": nbytes}
        )
        span.end()
