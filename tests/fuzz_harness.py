"""The frontend over scripted workers, served on its own thread's event loop, so that
synchronous property tests (hypothesis) can send it thousands of requests over real sockets
without a harness per example: its HTTP address and its gRPC Frontend address."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rtp_serve.services.common.pb import frontend_pb2_grpc
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from rtp_serve.services.frontend.auth import ApiKeys
from rtp_serve.services.frontend.grpc_api import FrontendServicer
from rtp_serve.services.frontend.limits import Limits
from tests.frontend_fakes import FakeWorker, Harness, frontend, serve_grpc

START_TIMEOUT_S = 30.0


@dataclass
class Served:
    url: str  # http://127.0.0.1:port
    grpc_address: str
    harness: Harness
    loop: asyncio.AbstractEventLoop

    def call(self, coro, timeout: float = 30.0):
        """Run `coro` on the frontend's loop (to read its state in place)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def served_frontend(
    model_dir: Path, worker: FakeWorker, limits: Limits | None = None, keys: ApiKeys | None = None
) -> Iterator[Served]:
    """The HTTP app and the gRPC Frontend over one fused fake `worker`, until the block ends;
    `keys`: the frontend's API keys (both ingresses)."""
    loop = asyncio.new_event_loop()
    ready: asyncio.Future[Served] = loop.create_future()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            workers = {"w1": (ns_pb2.ROLE_FUSED, worker)}
            async with frontend(model_dir, workers, limits=limits, keys=keys) as h:
                servicer = FrontendServicer(h.generator, keys)
                add = frontend_pb2_grpc.add_FrontendServicer_to_server
                server, address = await serve_grpc(add, servicer)
                url = str(h.client.make_url("")).rstrip("/")
                ready.set_result(Served(url, address, h, loop))
                await stop.wait()
                await server.stop(grace=None)
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        served = asyncio.run_coroutine_threadsafe(_wait(ready), loop).result(START_TIMEOUT_S)
        yield served
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(START_TIMEOUT_S)
        loop.close()


async def _wait(fut: asyncio.Future[Served]) -> Served:
    return await fut
