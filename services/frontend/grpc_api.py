"""rtp.v1.Frontend over gRPC: the same request path as the HTTP API (generation.py), as a
server stream. Refusals map to gRPC status codes (errors.ErrorKind)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
from opentelemetry import trace

from rtp_serve.core.validation import InvalidRequestError
from rtp_serve.services.common import tracing
from rtp_serve.services.common.convert import params_fields_from_pb, structured_from_pb
from rtp_serve.services.common.pb import frontend_pb2, frontend_pb2_grpc
from rtp_serve.services.frontend import auth
from rtp_serve.services.frontend.auth import ApiKeys
from rtp_serve.services.frontend.client_streams import grpc_peer_host
from rtp_serve.services.frontend.errors import FrontendError, invalid
from rtp_serve.services.frontend.generation import Generator
from rtp_serve.services.frontend.inputs import Options, prepare

DEFAULT_MAX_TOKENS = 16  # SamplingParams.max_tokens left at 0


def options_from_pb(
    request: frontend_pb2.FrontendGenerateRequest, timeout: float | None = None
) -> Options:
    """Proto3 zeros mean "unset": max_tokens 0 -> default, top_k 0 -> off, top_p 0 -> 1.
    `timeout`: what is left of the caller's gRPC deadline (the workers give up with it)."""
    try:
        sampling = params_fields_from_pb(request.params)
    except InvalidRequestError as exc:
        raise invalid(str(exc), exc.param) from None
    sampling["max_tokens"] = sampling["max_tokens"] or None
    structured = structured_from_pb(request.structured)
    if structured is not None:
        try:
            structured.validate("structured")
        except InvalidRequestError as exc:
            raise invalid(str(exc), exc.param) from None
    return Options(
        **sampling,
        structured=structured,
        stop=tuple(request.stop),
        session_id=request.session_id,
        priority=request.priority,
        timeout=timeout,
    )


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """What is left of the caller's deadline in seconds; None without one."""
    left = context.time_remaining()
    if left is None or left > 1e8:  # grpc reports "no deadline" as a huge number
        return None
    return max(left, 1e-3)


class FrontendServicer(frontend_pb2_grpc.FrontendServicer):
    def __init__(self, generator: Generator, keys: ApiKeys | None = None) -> None:
        self.generator = generator
        self.keys = keys or ApiKeys()

    async def Generate(
        self, request: frontend_pb2.FrontendGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[frontend_pb2.FrontendGenerateResponse]:
        metadata = dict(context.invocation_metadata() or ())
        if not self.keys.allows("Generate", metadata.get("authorization")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, auth.unauthorized().message)
        gen = self.generator
        request_id = "fe-" + secrets.token_hex(12)
        trace.get_current_span().set_attribute(tracing.REQUEST_ID, request_id)
        try:
            client = grpc_peer_host(context.peer())
            with gen.admission.admit(), gen.client_streams.admit(client):
                kind = request.WhichOneof("prompt")
                if kind == "text":
                    limit, chars = gen.model.context_len, gen.max_token_chars
                    gen.limits.check_prompt_chars(request.text, limit, chars, "text")
                    ids = gen.tokenizer.encode(request.text)
                elif kind == "token_ids":
                    ids = list(request.token_ids.ids)
                else:
                    raise invalid("prompt is required (text or token_ids)", "prompt")
                opts = options_from_pb(request, _deadline(context))
                self.keys.check_priority(opts.priority, metadata.get("authorization"))
                if request.model:
                    opts = replace(opts, lora=gen.resolve_model(request.model))
                (inp,) = prepare(gen.model, gen.limits, request_id, ids, opts, DEFAULT_MAX_TOKENS)
                tenant = self.keys.tenant(metadata.get("authorization"))
                trace.get_current_span().set_attribute(tracing.TENANT, tenant.name)
                with gen.tenants.admit(tenant, len(ids)) as lease:  # 429 over its limits
                    stream = await gen.start(replace(inp, tenant=lease))
                    async with contextlib.aclosing(stream):
                        async for delta in stream:
                            yield frontend_pb2.FrontendGenerateResponse(
                                text=delta.text,
                                token_ids=delta.token_ids,
                                logprobs=delta.logprobs,  # empty unless params.logprobs was set
                                finished=delta.finish_reason is not None,
                                finish_reason=delta.finish_reason or "",
                                prompt_tokens=delta.prompt_tokens,
                                completion_tokens=delta.completion_tokens,
                                cached_tokens=delta.cached_tokens,
                            )
        except FrontendError as exc:
            if exc.retry_after is not None:  # a tenant over its limit: when to come back
                context.set_trailing_metadata((("retry-after", str(exc.retry_after)),))
            await context.abort(exc.kind.grpc_code, exc.message)
