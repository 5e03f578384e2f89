"""`grpc_util.responses`, `cancel` and `unary` against a real grpc aio server: they give what
grpc's own API gives, and a caller that gives up ends (or, for `unary`, leaves to finish) the
call at the server, whenever it gives up. Their point, not leaking what grpcio leaks for an
interrupted wait, is measured by `bench/grpc_cancel.py`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from rtp_serve.services.common import grpc_util

MESSAGES = 5


def _same(b: bytes) -> bytes:
    return b


class Server:
    """Stream: MESSAGES messages once `go` is set (headers first when asked: request b"h");
    request b"fail" aborts after two. Unary: answers once `go` is set. Records how each
    handler ended."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.taken = asyncio.Event()
        self.ended: list[str] = []

    async def stream(self, request: bytes, context: grpc.aio.ServicerContext):
        self.taken.set()
        try:
            if request == b"h":
                await context.send_initial_metadata(())
            await self.go.wait()
            for i in range(MESSAGES):
                if request == b"fail" and i == 2:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
                yield bytes([i])
                await asyncio.sleep(0.01)
            self.ended.append("finished")
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.taken.set()
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise
        self.ended.append("finished")
        return b"reply"


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[tuple[Server, grpc.aio.Channel]]:
    behaviour = Server()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "t.Calls",
                {
                    "Stream": grpc.unary_stream_rpc_method_handler(behaviour.stream, _same, _same),
                    "Unary": grpc.unary_unary_rpc_method_handler(behaviour.unary, _same, _same),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield behaviour, channel
    finally:
        await channel.close()
        await server.stop(None)


def _stream(channel: grpc.aio.Channel, request: bytes) -> grpc.aio.UnaryStreamCall:
    return channel.unary_stream("/t.Calls/Stream", _same, _same)(request, timeout=10)


async def _ended_cancelled(server: Server, call: grpc.aio.UnaryStreamCall) -> None:
    """Until the call is done, cancelled, and the server's handler saw it so."""
    await _until(call.done)
    assert call.cancelled()
    await _until(lambda: server.ended)
    assert server.ended == ["cancelled"]


async def _until(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def test_responses_are_the_calls_messages_then_its_error():
    async def main():
        async with served() as (server, channel):
            server.go.set()
            got = [m async for m in grpc_util.responses(_stream(channel, b""))]
            assert got == [bytes([i]) for i in range(MESSAGES)]
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for m in grpc_util.responses(_stream(channel, b"fail"), depth=1):
                    got.append(m)
            assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert got == [b"\x00", b"\x01"]

    asyncio.run(main())


@pytest.mark.parametrize("headers", [True, False], ids=["headers-first", "headers-late"])
def test_a_reader_cancelled_before_the_first_message_cancels_the_call(headers):
    """Whether or not the server has sent its headers: cancelled once it takes the call."""

    async def main():
        async with served() as (server, channel):
            call = _stream(channel, b"h" if headers else b"")

            async def read() -> None:
                async for _ in grpc_util.responses(call):
                    pass

            reader = asyncio.create_task(read())
            await server.taken.wait()
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            if not headers:  # set up only when the server answers: then cancelled
                server.go.set()
            await _ended_cancelled(server, call)

    asyncio.run(main())


def test_leaving_or_cancelling_the_iteration_midstream_cancels_the_call():
    async def main():
        async with served() as (server, channel):
            server.go.set()
            call = _stream(channel, b"")
            async for _ in grpc_util.responses(call, depth=1):
                break  # the consumer leaves; the reader may be waiting to put the next
            await _ended_cancelled(server, call)

            server.ended.clear()
            call = _stream(channel, b"")
            first = asyncio.Event()

            async def read() -> None:
                async for _ in grpc_util.responses(call):
                    first.set()

            reader = asyncio.create_task(read())
            await first.wait()
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            await _ended_cancelled(server, call)

    asyncio.run(main())


def test_a_cancelled_unary_caller_leaves_the_call_to_finish():
    async def main():
        async with served() as (server, channel):
            call = channel.unary_unary("/t.Calls/Unary", _same, _same)(b"", timeout=10)
            caller = asyncio.create_task(grpc_util.unary(call))
            await server.taken.wait()
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            server.go.set()
            await _until(call.done)
            assert not call.cancelled() and await call == b"reply"
            assert server.ended == ["finished"]

    asyncio.run(main())


def test_a_server_that_never_answers_has_its_call_cancelled_after_the_wait(monkeypatch):
    monkeypatch.setattr(grpc_util, "CANCEL_WAIT_S", 0.2)

    async def main():
        async with served() as (server, channel):
            call = _stream(channel, b"")  # no headers until `go`, which never comes
            await server.taken.wait()
            grpc_util.cancel(call)
            await _ended_cancelled(server, call)

    asyncio.run(main())
