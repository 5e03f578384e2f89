"""Many Generate streams of one caller over one call: rtp.v1.Worker/Streams.

A frontend opens one Streams call per worker and sends on it each request it routes there
(`open`: the GenerateRequest, its deadline and its trace context) and each it gives up
(`cancel`). Every request runs exactly as its own Generate call would: the same handler,
drain guard, trace span and deadline, its refusals and failures the same gRPC statuses
(carried per request in `StreamOutput.code`, the failed peer with them). What changes is
the wire: after each engine step the call sends one StreamsReply holding every request's
new message, where Generate sends one message per request. Per message, gRPC costs an
HTTP/2 write, a wake-up of the asyncio loop through its poller and thread hand-offs on both
sides (docs/benchmarks.md: the serving path's syscalls per token); at 16 streams a step
that was 16 of each is now one.

The call ends when the caller cancels it or goes away (every request still running on it
is aborted, its blocks freed), or when the server stops (the caller's requests then fail
UNAVAILABLE and migrate, as with Generate).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from rtp_serve.services.common import grpc_util, tracing
from rtp_serve.services.common.pb import worker_pb2

log = logging.getLogger(__name__)

GENERATE = "rtp.v1.Worker/Generate"

Handler = Callable[[worker_pb2.GenerateRequest, Any], AsyncIterator[worker_pb2.GenerateResponse]]


class Aborted(Exception):
    """A request's handler ended its stream with this status (context.abort)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class RequestContext:
    """What a Generate handler uses of grpc.aio.ServicerContext, for one request of a
    Streams call: abort raises `Aborted` (that request's end, not the call's)."""

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.trailing: tuple[tuple[str, str], ...] = ()

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: object) -> None:
        self._code, self._details = code, details
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing = tuple(metadata)

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        """Nothing to send: the call's own headers went out when it opened."""

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def code(self) -> grpc.StatusCode | None:  # read by the trace span's end
        return self._code

    def details(self) -> str:
        return self._details

    def failed_peer(self) -> str:
        return next((v for k, v in self.trailing if k == grpc_util.FAILED_PEER_KEY), "")


async def serve(
    handler: Handler,
    requests: AsyncIterator[worker_pb2.StreamsRequest],
    context: grpc.aio.ServicerContext,
) -> AsyncIterator[worker_pb2.StreamsReply]:
    """The Streams call: `handler` (the servicer's Generate) for each request opened on
    it, their messages batched into one reply per turn of the event loop."""
    outbox: list[worker_pb2.StreamOutput] = []
    ready = asyncio.Event()
    running: dict[str, asyncio.Task[None]] = {}

    def emit(output: worker_pb2.StreamOutput) -> None:
        outbox.append(output)
        ready.set()

    async def run(msg: worker_pb2.StreamsRequest) -> None:
        request_id = msg.open.request_id
        ctx = RequestContext(msg.timeout_s)
        stream = tracing.traced_stream(handler, GENERATE, dict(msg.trace))(msg.open, ctx)
        end = worker_pb2.StreamOutput(request_id=request_id)
        try:
            async with asyncio.timeout(msg.timeout_s if msg.timeout_s > 0 else None):
                async with contextlib.aclosing(stream) as responses:
                    async for response in responses:
                        emit(worker_pb2.StreamOutput(request_id=request_id, response=response))
        except Aborted as exc:
            end.code, end.details = exc.code.value[0], exc.details
            end.failed_peer = ctx.failed_peer()
        except TimeoutError:
            end.code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            end.details = "deadline exceeded"
        except asyncio.CancelledError:
            return  # the caller cancelled it, or the call is over: nobody to tell
        except Exception as exc:  # what grpc would end a Generate call with: UNKNOWN
            log.exception("request %s failed", request_id, extra={"request_id": request_id})
            end.code = grpc.StatusCode.UNKNOWN.value[0]
            end.details = f"{type(exc).__name__}: {exc}"
        finally:
            if running.get(request_id) is asyncio.current_task():
                del running[request_id]
        emit(end)

    async def read() -> None:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("kind")
                if kind == "open":
                    request_id = msg.open.request_id
                    if request_id in running:
                        emit(_refused(request_id, f"request {request_id!r} is already running"))
                        continue
                    running[request_id] = asyncio.create_task(run(msg), name=request_id)
                elif kind == "cancel" and (task := running.pop(msg.cancel, None)) is not None:
                    task.cancel()
        finally:
            ready.set()  # the writer sees the caller's side end

    reader = asyncio.create_task(read(), name="streams reader")
    try:
        while True:
            await ready.wait()
            ready.clear()
            if outbox:
                batch = outbox[:]
                outbox.clear()
                yield worker_pb2.StreamsReply(outputs=batch)
            if reader.done() and (reader.exception() is not None or not running and not outbox):
                break  # the caller is done and so is every request, or its stream broke
        reader.result()  # the caller's messages ended in an error: the call's
    finally:
        reader.cancel()
        for task in running.values():
            task.cancel()
        await asyncio.gather(reader, *running.values(), return_exceptions=True)


def _refused(request_id: str, details: str) -> worker_pb2.StreamOutput:
    return worker_pb2.StreamOutput(
        request_id=request_id, code=grpc.StatusCode.ALREADY_EXISTS.value[0], details=details
    )
