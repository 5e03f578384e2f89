"""A worker's graceful stop: refuse new calls, let those in flight finish for a while.

SIGTERM -> begin()            new Generate/Prefill calls: UNAVAILABLE (the caller retries
                              elsewhere); the worker also leaves the nameservice
        -> wait(timeout)      until no call is in flight, or --drain-timeout passed
        -> engine shutdown    what is left ends UNAVAILABLE: the frontend resumes those
                              streams on another worker
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import grpc

T = TypeVar("T")


class Drain:
    def __init__(self) -> None:
        self.admitting = True
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.admitting = False

    async def wait(self, timeout: float) -> bool:
        """True if every call in flight finished within `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._idle.is_set()

    @contextlib.contextmanager
    def _track(self) -> Iterator[None]:
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def guard(
        self, stream: AsyncIterator[T], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[T]:
        """`stream` (a call's responses), counted as in flight; refused while draining."""
        if not self.admitting:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "worker is shutting down: not taking new requests"
            )
        with self._track():
            # Our headers now, not with the first token: the caller's call is set up once it
            # has them, and `grpc_util.cancel` waits for that (grpcio leaks native memory for
            # a call cancelled while it is set up), so a caller that gives up while we queue
            # or prefill stops us at once.
            await context.send_initial_metadata(())
            async with contextlib.aclosing(stream) as messages:  # type: ignore[type-var]
                async for msg in messages:
                    yield msg


def drained(handler: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Decorates a streaming RPC of a servicer that has a `drain`: refused while draining,
    counted as in flight while it runs."""

    @functools.wraps(handler)
    async def rpc(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        stream = self.drain.guard(handler(self, request, context), context)
        async with contextlib.aclosing(stream) as messages:
            async for msg in messages:
                yield msg

    return rpc
