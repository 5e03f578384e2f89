"""The routes this frontend asks of one master, and the releases it sends it, coalesced.

A route goes at once when no call to the master is in flight: alone, as a plain Route call,
so a lone request pays nothing and keeps its trace. The routes that arrive while a call is
in flight wait for it and then go together as one RouteBatch call (at most MAX_BATCH), so
under load each of the master's calls, whose fixed cost in gRPC and in the charge
exchange's publish is more than a route's own work, answers many routes (group commit).

Each route fails as a Route call would, with a grpc.aio.AioRpcError: its own status from
the batch's outcome, the whole call's status, or DEADLINE_EXCEEDED at its own deadline (the
call goes on without it, as a unary call does: grpc_util.unary). A master that does not know
RouteBatch (an older one, during an upgrade) is sent plain Route calls from then on.

Releases (requests that ended, whose leases the master holds) go the same way: at once, as
a plain Release call, when no call is in flight, else with the next call. They are best
effort: a lost one keeps a client's retry through another frontend waiting until the lease
expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from rtp_serve.services.common.pb import master_pb2, master_pb2_grpc

log = logging.getLogger(__name__)

MAX_BATCH = 256  # routes per RouteBatch call (the master takes up to 1,024)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@dataclass(slots=True)
class _Ask:
    request: master_pb2.RouteRequest
    deadline: float  # monotonic
    done: asyncio.Future[master_pb2.RoutePlan]
    context: contextvars.Context  # the caller's (its trace), for a call of its own
    span: trace.Span


@dataclass(slots=True)
class _Release:
    request: master_pb2.ReleaseRequest
    context: contextvars.Context  # the caller's (its trace), for a call of its own


class RouteBatcher:
    def __init__(
        self,
        stub: Callable[[], master_pb2_grpc.MasterStub],
        max_batch: int = MAX_BATCH,
        release_timeout_s: float = 2.0,
    ) -> None:
        self._stub = stub  # the master's stub, on its current channel
        self._max_batch = max_batch
        self._release_timeout_s = release_timeout_s
        self._waiting: list[_Ask] = []
        self._releases: list[_Release] = []
        self._sender: asyncio.Task[None] | None = None
        self._batches = True  # False: the master answered RouteBatch with UNIMPLEMENTED
        self.calls = 0  # calls made (Route and RouteBatch)

    async def route(self, request: master_pb2.RouteRequest, timeout: float) -> master_pb2.RoutePlan:
        """The master's plan for `request` within `timeout` seconds."""
        done: asyncio.Future[master_pb2.RoutePlan] = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieved)
        ask = _Ask(
            request,
            time.monotonic() + timeout,
            done,
            contextvars.copy_context(),
            trace.get_current_span(),
        )
        self._waiting.append(ask)
        self._wake()
        try:
            return await asyncio.wait_for(asyncio.shield(done), max(0.0, timeout))
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    def release(self, ended: master_pb2.ReleaseRequest) -> None:
        """Release `ended`'s lease at the master, with the next call (or now, as one)."""
        self._releases.append(_Release(ended, contextvars.copy_context()))
        self._wake()

    async def flush(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for what is waiting or in flight (at close)."""
        if self._sender is not None:
            await asyncio.wait({self._sender}, timeout=timeout)

    def _wake(self) -> None:
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_waiting(), name="route-batcher")

    async def _send_waiting(self) -> None:
        try:
            while self._waiting or self._releases:
                batch = self._waiting[: self._max_batch]
                del self._waiting[: len(batch)]
                batch = [a for a in batch if not a.done.done()]  # gone: timed out waiting
                ended, self._releases = self._releases, []
                try:
                    await self._send(batch, ended)
                except Exception as e:  # a closed channel, a bug: no route waits forever
                    log.exception("sending %d routes to the master failed", len(batch))
                    for a in batch:
                        _fail(a, rpc_error(grpc.StatusCode.UNAVAILABLE, repr(e)))
        finally:
            self._sender = None

    async def _send(self, batch: list[_Ask], ended: list[_Release]) -> None:
        if not self._batches:
            await asyncio.gather(
                *(self._alone(a) for a in batch), *(self._release(r) for r in ended)
            )
        elif len(batch) == 1 and not ended:
            await self._alone(batch[0])
        elif not batch and len(ended) == 1:
            await self._release(ended[0])
        elif batch or ended:
            await self._together(batch, ended)

    async def _release(self, ended: _Release) -> None:
        """One release as a plain Release call, in its caller's context (its trace)."""
        stub = self._stub()

        async def call() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Release(ended.request, timeout=self._release_timeout_s)

        self.calls += 1
        await asyncio.create_task(call(), context=ended.context)

    async def _alone(self, ask: _Ask) -> None:
        """One route as a plain Route call, in its caller's context (its trace)."""
        stub = self._stub()

        async def call() -> master_pb2.RoutePlan:
            return await stub.Route(ask.request, timeout=_left(ask.deadline))

        self.calls += 1
        try:
            _resolve(ask, await asyncio.create_task(call(), context=ask.context))
        except grpc.aio.AioRpcError as e:
            _fail(ask, e)

    async def _together(self, batch: list[_Ask], ended: list[_Release]) -> None:
        message = master_pb2.RouteBatchRequest(
            requests=[a.request for a in batch], releases=[r.request for r in ended]
        )
        timeout = _left(max(a.deadline for a in batch)) if batch else self._release_timeout_s
        self.calls += 1
        try:
            # No caller's trace is the call's parent; each caller's span notes the batch.
            with trace.use_span(trace.INVALID_SPAN):
                reply = await self._stub().RouteBatch(message, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("the master does not know RouteBatch: sending Route calls")
                self._batches = False
                await asyncio.gather(
                    *(self._alone(a) for a in batch), *(self._release(r) for r in ended)
                )
                return
            for a in batch:
                _fail(a, e)
            if ended:
                log.debug("%d releases lost: %s", len(ended), e.details() or e.code().name)
            return
        if len(reply.outcomes) != len(batch):
            error = rpc_error(
                grpc.StatusCode.INTERNAL,
                f"RouteBatch answered {len(reply.outcomes)} of {len(batch)} routes",
            )
            for a in batch:
                _fail(a, error)
            return
        for a, outcome in zip(batch, reply.outcomes, strict=True):
            a.span.add_event("route batch", {"rtp.route.batch_size": len(batch)})
            if outcome.code:
                code = _CODES.get(outcome.code, grpc.StatusCode.UNKNOWN)
                _fail(a, rpc_error(code, outcome.details))
            else:
                _resolve(a, outcome.plan)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _resolve(ask: _Ask, plan: master_pb2.RoutePlan) -> None:
    if not ask.done.done():
        ask.done.set_result(plan)


def _fail(ask: _Ask, error: grpc.aio.AioRpcError) -> None:
    if not ask.done.done():
        ask.done.set_exception(error)


def _retrieved(done: asyncio.Future[master_pb2.RoutePlan]) -> None:
    """Mark an error as seen: its caller may have stopped waiting (its own deadline)."""
    with contextlib.suppress(asyncio.CancelledError):
        done.exception()
