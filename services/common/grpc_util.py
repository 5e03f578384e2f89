"""gRPC plumbing shared by every service: servers with health checking, and channels.

KV blocks travel as raw bytes, so message size limits are raised well above gRPC's 4 MiB.
Servers and channels use the process's transport security (`use_tls`; see `tls`): mutual
TLS when configured, plaintext otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rtp_serve.services.common import tls as tls_config
from rtp_serve.services.common import tracing
from rtp_serve.services.common.grpc_malformed import MalformedRequests
from rtp_serve.services.common.tls import TlsConfig

MAX_MESSAGE_BYTES = 256 << 20
# Trailing metadata of a worker call that failed because a peer it called failed (a decode
# worker's prefill worker): that peer's address, so the caller routes around the right one.
FAILED_PEER_KEY = "rtp-failed-peer"
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
# Servers ping their clients on idle connections: a caller that vanished without closing
# its connection (a host gone, a partition) has its calls cancelled within about 40 s, so
# a worker stops computing for it. Only servers ping (clients pinging more often than a
# server allows would be sent away).
_SERVER_OPTIONS = [
    *_OPTIONS,
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]

_UNSET = object()
_process_tls: TlsConfig | None | object = _UNSET


def use_tls(config: TlsConfig | None) -> None:
    """Set the process's transport security, once at start (None: plaintext)."""
    global _process_tls
    _process_tls = config


def process_tls() -> TlsConfig | None:
    """What `use_tls` set; until it is called, what the RTP_TLS_* environment says."""
    global _process_tls
    if _process_tls is _UNSET:
        _process_tls = tls_config.from_env()
    return _process_tls  # type: ignore[return-value]


def create_server(
    bind: str = "127.0.0.1:0", tls: TlsConfig | None = None
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A started-later aio server bound to `bind` (port 0: any free port), with the standard
    health service registered; mutual TLS with `tls`, else the process's. Returns (server,
    port, health servicer)."""
    interceptors = [*tracing.server_interceptors(), MalformedRequests()]
    server = grpc.aio.server(options=_SERVER_OPTIONS, interceptors=interceptors)
    tls = tls or process_tls()
    if tls is None:
        port = server.add_insecure_port(bind)
    else:
        port = server.add_secure_port(bind, tls.server_credentials())
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {bind}")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, port, health_servicer


async def set_serving(
    health_servicer: health.aio.HealthServicer, service: str, serving: bool
) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    await health_servicer.set(service, status)
    await health_servicer.set("", status)
    if not serving:
        # Let open Watch streams carry NOT_SERVING before the caller stops the server (a
        # load balancer then drains this instance instead of seeing a broken stream).
        await asyncio.sleep(0.1)


def channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A channel to `address`: presenting `tls` (else the process's) certificate, if any."""
    interceptors = tracing.client_interceptors(address)  # trace context, when tracing is on
    tls = tls or process_tls()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address,
        tls.channel_credentials(),
        options=_OPTIONS + tls.channel_options(),
        interceptors=interceptors,
    )


class ChannelCache:
    """One client channel per peer address, opened on first use; the one cache of them every
    service keeps."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address)
        return ch

    def __contains__(self, address: str) -> bool:
        return address in self._channels

    def addresses(self) -> list[str]:
        return list(self._channels)

    def drop(self, address: str, grace: float | None = None) -> None:
        """Forget a peer; its channel closes in the background (calls in flight get `grace`)."""
        ch = self._channels.pop(address, None)
        if ch is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: nothing can be in flight on it either
            return
        task = loop.create_task(ch.close(grace=grace))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(ch.close() for ch in channels), *self._closing)


# Calls cancelled in the background (`cancel`), reads and unary calls left to end by themselves.
_detached: set[asyncio.Future[Any]] = set()


def _detach(aw: Any) -> asyncio.Future[Any]:
    task = asyncio.ensure_future(aw)
    _detached.add(task)
    task.add_done_callback(_finished)
    return task


def _finished(task: asyncio.Future[Any]) -> None:
    _detached.discard(task)
    if not task.cancelled():
        task.exception()  # the call's error, nobody's to handle now: not logged as lost


# grpcio's asyncio calls (1.82-1.85) leak native memory when a coroutine is cancelled while it
# waits inside grpc: about 400 bytes per interrupted read of a stream, 100 per stream call
# cancelled before it is set up (before the server's headers came), 1 KiB per unary call. A
# frontend pays one on each client that gives up mid-request (`bench/grpc_cancel.py` measures
# them). So callers here never interrupt a wait inside grpc: they read streams through
# `responses`, end them with `cancel`, and await unary calls through `unary`.


_END = object()
CANCEL_WAIT_S = 5.0


async def responses(call: grpc.aio.UnaryStreamCall, depth: int = 8) -> AsyncIterator[Any]:
    """The messages of a server stream, as `async for msg in call` gives them, errors
    included. A task of its own reads the call, at most `depth` messages ahead; ending or
    cancelling the iteration cancels the call (`cancel`), and the reader ends with it."""
    queue: asyncio.Queue[Any] = asyncio.Queue(depth)
    closed = False

    async def read() -> None:
        try:
            async for msg in call:
                await queue.put(msg)
                if closed:
                    return
        except BaseException as exc:  # the call's error or its cancellation: the reader's
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # this task's own (the loop ends)
                raise
            if not closed:
                await queue.put(exc)
        else:
            await queue.put(_END)

    reader = _detach(read())
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        closed = True
        if not reader.done():
            cancel(call)
            while not queue.empty():  # a reader waiting to put sees `closed` and ends
                queue.get_nowait()


def cancel(call: grpc.aio.UnaryStreamCall) -> None:
    """End `call` (a no-op once it is done), once it is set up: the server sends its headers
    as soon as it takes a call (`rtp_serve.services.worker.drain`), so that is one round trip. A server
    that has not answered in CANCEL_WAIT_S has its call cancelled anyway."""
    if call.done():
        return

    async def once_set_up() -> None:
        set_up = _detach(call.wait_for_connection())
        await asyncio.wait((set_up,), timeout=CANCEL_WAIT_S)
        call.cancel()

    _detach(once_set_up())


async def unary(call: grpc.aio.UnaryUnaryCall) -> Any:
    """The reply of a unary call. Cancelling the caller does not cancel the call: it runs to
    its end, which its timeout bounds, and its reply is dropped."""
    return await asyncio.shield(_detach(call))


async def check_health(address: str, timeout: float = 1.0, tls: TlsConfig | None = None) -> bool:
    """True if the gRPC server at `address` answers SERVING."""
    async with channel(address, tls) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
