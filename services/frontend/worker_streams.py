"""A worker's Generate streams, many over one call (rtp.v1.Worker/Streams).

This frontend keeps one Streams call open per worker and sends each request it routes there
on it; the worker answers each engine step with one message holding every request's new
tokens (services/worker/streams.py says why). `generate` gives one request's messages
as a Generate call's would be read: the same messages, the same errors (grpc.aio.AioRpcError
with the code, details and failed peer its own call would have ended with), and closing it
early cancels the request on the worker. A worker that does not say it has Streams
(`Member.streams`: one from before them, during a rolling upgrade) gets a Generate call per
request, as before.

A call that ends (the worker died, stopped or was cut off) ends every request on it with
UNAVAILABLE, which the caller migrates; the next request opens a new call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from rtp_serve.services.common import grpc_util, tracing
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from rtp_serve.services.common.pb import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

GENERATE = "rtp.v1.Worker/Generate"
_DEADLINE = object()  # queued when a request's deadline passes
_Item = worker_pb2.StreamOutput | grpc.aio.AioRpcError | object
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str, failed_peer: str = "") -> grpc.aio.AioRpcError:
    """The error a Generate call would have raised."""
    trailing = ((grpc_util.FAILED_PEER_KEY, failed_peer),) if failed_peer else ()
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


class _Call:
    """One Streams call to a worker, and the requests on it."""

    def __init__(
        self,
        address: str,
        stub: worker_pb2_grpc.WorkerStub,
        on_closed: Callable[[_Call], None],
    ) -> None:
        self.address = address
        self.closed = False
        self._on_closed = on_closed
        self._outgoing: asyncio.Queue[worker_pb2.StreamsRequest | None] = asyncio.Queue()
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        # Opened outside any request's trace: the call is no request's, each request's own
        # context travels in its `open`.
        empty = contextvars.Context()
        self._call = empty.run(stub.Streams, self._requests())
        self._reader = empty.run(asyncio.ensure_future, self._read())

    async def _requests(self) -> AsyncIterator[worker_pb2.StreamsRequest]:
        while (msg := await self._outgoing.get()) is not None:
            yield msg

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"worker {self.address} ended the stream")
        try:
            async for reply in self._call:
                for output in reply.outputs:
                    queue = self._streams.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
        except grpc.aio.AioRpcError as exc:
            error = exc
            if exc.code() == grpc.StatusCode.CANCELLED:  # not by us: the server stopped it
                error = rpc_error(
                    grpc.StatusCode.UNAVAILABLE, f"worker {self.address} cancelled the stream"
                )
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the frontend is closing")
        finally:
            self.closed = True
            for queue in self._streams.values():
                queue.put_nowait(error)
            self._streams.clear()
            self._on_closed(self)

    def open(
        self, request: worker_pb2.GenerateRequest, timeout: float | None, trace: dict[str, str]
    ) -> asyncio.Queue[_Item]:
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._outgoing.put_nowait(
            worker_pb2.StreamsRequest(open=request, timeout_s=timeout or 0.0, trace=trace)
        )
        return queue

    def cancel(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and not self.closed:
            self._outgoing.put_nowait(worker_pb2.StreamsRequest(cancel=request_id))

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def close(self) -> None:
        self._outgoing.put_nowait(None)
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class WorkerStreams:
    """The Streams calls of this frontend, one per worker address."""

    def __init__(self, channel: Callable[[str], grpc.aio.Channel]) -> None:
        self._channel = channel
        self._calls: dict[str, _Call] = {}

    async def generate(
        self, worker: ns_pb2.Member, request: worker_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """One request's messages from `worker`, as its own Generate call would give them
        (errors included); closing the iteration early cancels it there. Over the worker's
        Streams call where it has one (Member.streams), else on a Generate call."""
        if worker.streams:
            messages = self._shared(worker.address, request, timeout)
        else:
            stub = worker_pb2_grpc.WorkerStub(self._channel(worker.address))
            messages = grpc_util.responses(stub.Generate(request, timeout=timeout))
        # Closed here, not when collected: closing this stream early cancels the request now.
        async with contextlib.aclosing(messages) as inner:
            async for msg in inner:
                yield msg

    async def _shared(
        self,
        address: str,
        request: worker_pb2.GenerateRequest,
        timeout: float | None,
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        call = self._calls.get(address)
        if call is None or call.closed:
            stub = worker_pb2_grpc.WorkerStub(self._channel(address))
            call = self._calls[address] = _Call(address, stub, self._forget)
        trace: dict[str, str] = {}
        span = tracing.client_span(GENERATE, address, trace)
        queue = call.open(request, timeout, trace)
        # The deadline as one timer that queues its passing, not a timed wait per message
        # (asyncio.wait_for makes a task each time: 5% of this frontend's CPU at 16 streams).
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(timeout, queue.put_nowait, _DEADLINE)
        code, details, over = grpc.StatusCode.CANCELLED, "the caller stopped reading", False
        try:
            while True:
                item = await queue.get()
                if item is _DEADLINE:
                    code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
                    raise rpc_error(code, details)
                if isinstance(item, grpc.aio.AioRpcError):  # the call's end: every request's
                    over = True
                    code, details = item.code(), item.details() or ""
                    raise rpc_error(code, details)
                if item.code:
                    over = True
                    code, details = _CODES.get(item.code, grpc.StatusCode.UNKNOWN), item.details
                    raise rpc_error(code, details, item.failed_peer)
                if not item.HasField("response"):  # the end, OK
                    over = True
                    code, details = grpc.StatusCode.OK, ""
                    return
                # A finished request's end follows: nothing to cancel if the reader stops here.
                over = item.response.finished
                yield item.response
        finally:
            if timer is not None:
                timer.cancel()
            if over:
                call.forget(request.request_id)
            else:
                call.cancel(request.request_id)  # the worker aborts it and frees its blocks
            if span is not None:
                tracing.end_client_span(span, code, details)

    def _forget(self, call: _Call) -> None:
        """A call that ended leaves the table (a worker that went away leaves nothing)."""
        if self._calls.get(call.address) is call:
            del self._calls[call.address]

    async def close(self) -> None:
        calls, self._calls = list(self._calls.values()), {}
        await asyncio.gather(*(call.close() for call in calls), return_exceptions=True)
