"""Bytes that are not the method's request message get INVALID_ARGUMENT, on every gRPC
server (grpc_util.create_server installs this).

grpc answers a request it cannot deserialize with UNKNOWN ("Unexpected DecodeError"),
which reads as a server bug. This interceptor makes each method's deserializer hand a
`Malformed` marker to a wrapper that refuses it with the parse error: before calling the
servicer for a unary request, or as the servicer reads it from a request stream (a
bidirectional call then ends INVALID_ARGUMENT at its first bad message).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(frozen=True, slots=True)
class Malformed:
    error: str


def _safe(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # DecodeError, or whatever a custom deserializer raises
            return Malformed(f"{type(exc).__name__}: {exc}")

    return parse


async def _refuse(request: Malformed, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message: {request.error}"
    )


def _guard_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await _refuse(request, context)
        return await behavior(request, context)

    return call


def _guard_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):  # writes through context.write
        return _guard_unary(behavior)

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await _refuse(request, context)
        async for message in behavior(request, context):
            yield message

    return call


def _guard_requests(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """A stream-stream handler whose request messages are checked as it reads them."""

    async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async def checked() -> Any:
            async for request in requests:
                if isinstance(request, Malformed):
                    await _refuse(request, context)
                yield request

        async for message in behavior(checked(), context):
            yield message

    return call


class MalformedRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        safe = _safe(handler.request_deserializer)
        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            return handler._replace(
                request_deserializer=safe, stream_stream=_guard_requests(handler.stream_stream)
            )
        if handler.request_streaming:
            return handler
        if handler.unary_unary is not None:
            return handler._replace(
                request_deserializer=safe, unary_unary=_guard_unary(handler.unary_unary)
            )
        if handler.unary_stream is not None:
            return handler._replace(
                request_deserializer=safe, unary_stream=_guard_stream(handler.unary_stream)
            )
        return handler
