"""The frontend's hold for a worker (scale from zero): off, waiting, bounded, refused."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Gauge

from rtp_serve.services.frontend.cold_start import WorkerWait
from rtp_serve.services.frontend.errors import ErrorKind, FrontendError


def _wait(routable, hold_s: float = 5.0, max_waiting: int = 2) -> tuple[WorkerWait, Gauge]:
    gauge = Gauge("waiting", "held", registry=CollectorRegistry())
    return WorkerWait(routable, hold_s, max_waiting, gauge), gauge


def test_off_or_routable_returns_at_once() -> None:
    async def run() -> None:
        ready, _ = _wait(lambda: True)
        await ready.until_routable(None)
        off, _ = _wait(lambda: False, hold_s=0)
        await off.until_routable(None)  # the route call then says 503, as without holding

    asyncio.run(run())


def test_a_held_request_goes_on_once_a_worker_registers() -> None:
    workers: list[str] = []

    async def run() -> None:
        wait, gauge = _wait(lambda: bool(workers))
        held = asyncio.create_task(wait.until_routable(None))
        await asyncio.sleep(0.2)
        assert not held.done() and wait.waiting == 1 and gauge._value.get() == 1
        workers.append("fused-0")
        await asyncio.wait_for(held, 5)
        assert wait.waiting == 0 and gauge._value.get() == 0

    asyncio.run(run())


def test_the_hold_is_bounded_by_its_time_the_deadline_and_the_queue() -> None:
    async def run() -> None:
        wait, gauge = _wait(lambda: False, hold_s=0.2, max_waiting=1)
        with pytest.raises(FrontendError) as timed_out:
            await wait.until_routable(None)
        assert timed_out.value.kind == ErrorKind.UNAVAILABLE and "0.2 s" in str(timed_out.value)
        with pytest.raises(FrontendError) as deadline:
            await wait.until_routable(0.05)  # the request's own deadline is shorter
        assert "0.1 s" in str(deadline.value) or "0.0 s" in str(deadline.value)
        first = asyncio.create_task(wait.until_routable(None))
        await asyncio.sleep(0.05)
        with pytest.raises(FrontendError) as full:
            await wait.until_routable(None)
        assert "already wait" in str(full.value)
        with pytest.raises(FrontendError):
            await first
        assert wait.waiting == 0 and gauge._value.get() == 0

    asyncio.run(run())
