"""Nameservice: the registry exactly (fake clock), then the real `rtp-serve nameservice`
process with real clients, Watch streams and NATS."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.naming import NameClient, make_member
from rtp_serve.services.common.pb import nameservice_pb2 as pb
from rtp_serve.services.launcher.servers import free_port
from rtp_serve.services.nameservice.registry import Registry
from tests.procs import spawn, stop, wait_grpc
from tests.servers import eventually

Event = pb.MembershipEvent
TTL = 1.0
NAMESPACE = "nstest"


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _kinds(events: list[Event]) -> list[tuple[str, str, str]]:
    return [(Event.Kind.Name(e.kind), e.member.id, e.reason) for e in events]


# -- registry (pure) --------------------------------------------------------------------


def test_registry_expires_exactly_at_ttl() -> None:
    clock = FakeClock(100.0)
    reg = Registry(ttl=3.0, clock=clock)
    a, b = pb.Member(id="a", role=pb.ROLE_PREFILL), pb.Member(id="b", role=pb.ROLE_DECODE)
    assert _kinds(reg.register(a)) == [("KIND_JOINED", "a", "")]
    clock.now = 101.0
    reg.register(b)
    clock.now = 102.0
    assert reg.heartbeat("a")  # a: last seen 102, b: 101
    assert reg.expire(103.999) == []
    assert _kinds(reg.expire(104.0)) == [("KIND_LEFT", "b", "expired")]
    assert reg.expire(104.999) == [] and "a" in reg
    assert _kinds(reg.expire(105.0)) == [("KIND_LEFT", "a", "expired")]
    assert len(reg) == 0 and not reg.heartbeat("a")


def test_registry_forgives_a_pause_of_its_own() -> None:
    clock = FakeClock(100.0)
    reg = Registry(ttl=3.0, clock=clock)
    reg.register(pb.Member(id="a", role=pb.ROLE_FUSED))
    clock.now = 110.0  # the service was stopped for 9 s; a's heartbeats wait in its socket
    reg.forgive(9.0)
    assert reg.expire() == []  # a was silent 1 s of the time the service ran
    assert _kinds(reg.expire(102.999 + 9.0)) == []
    assert _kinds(reg.expire(103.0 + 9.0)) == [("KIND_LEFT", "a", "expired")]


def test_registry_reregister_replaces() -> None:
    reg = Registry(ttl=3.0, clock=FakeClock())
    first = pb.Member(id="d1", role=pb.ROLE_DECODE, address="127.0.0.1:1")
    reg.register(first)
    assert reg.register(first) == [], "the same member again is only a heartbeat"
    moved = pb.Member(id="d1", role=pb.ROLE_DECODE, address="127.0.0.1:2")
    assert _kinds(reg.register(moved)) == [
        ("KIND_LEFT", "d1", "replaced"),
        ("KIND_JOINED", "d1", ""),
    ]
    assert reg.members() == [moved] and reg.get("d1") == moved


def test_registry_lists_by_role_and_deregisters() -> None:
    reg = Registry(ttl=3.0, clock=FakeClock())
    members = [
        pb.Member(id="p1", role=pb.ROLE_PREFILL),
        pb.Member(id="d1", role=pb.ROLE_DECODE),
        pb.Member(id="p2", role=pb.ROLE_PREFILL),
    ]
    for m in members:
        reg.register(m)
    assert [m.id for m in reg.members(pb.ROLE_PREFILL)] == ["p1", "p2"]
    assert [m.id for m in reg.members()] == ["p1", "d1", "p2"]
    assert reg.members(pb.ROLE_CACHE) == []
    reg.members()[0].address = "mutated"  # callers get copies
    assert reg.get("p1").address == ""
    assert _kinds(reg.deregister("d1")) == [("KIND_LEFT", "d1", "deregistered")]
    assert reg.deregister("d1") == []
    with pytest.raises(ValueError):
        reg.register(pb.Member(role=pb.ROLE_DECODE))


# -- the real service -------------------------------------------------------------------


@pytest.fixture(scope="module")
def nameservice(nats_server: str) -> Iterator[str]:
    port = free_port()
    flags = ("--port", str(port), "--ttl", str(TTL), "--nats-url", nats_server)
    proc = spawn("nameservice", *flags, "--namespace", NAMESPACE)
    address = f"127.0.0.1:{port}"
    try:
        wait_grpc(address, proc, timeout=20)
        yield address
    finally:
        assert stop(proc) == 0


async def _pump(events: AsyncIterator[Event], into: asyncio.Queue[Event]) -> None:
    async for event in events:
        await into.put(event)


async def _next(queue: asyncio.Queue[Event], member_id: str, timeout: float = 3.0) -> Event:
    """The next event about `member_id` (others, from other tests' members, are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        event = await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0.01))
        if event.member.id == member_id:
            return event


def test_watch_join_expiry_and_deregister(nameservice: str, nats_server: str) -> None:
    async def main() -> None:
        on_nats: asyncio.Queue[Event] = asyncio.Queue()
        bus = await Bus.connect(nats_server, "observer")
        await bus.subscribe(subjects.membership(NAMESPACE), Event, lambda e, h: on_nats.put(e))
        a, b, observer = NameClient(nameservice), NameClient(nameservice), NameClient(nameservice)
        ma = make_member(pb.ROLE_PREFILL, "127.0.0.1:1001", model="tiny", capacity=4)
        mb = make_member(pb.ROLE_DECODE, "127.0.0.1:1002")
        assert ma.id.startswith("prefill-") and mb.id.startswith("decode-")
        await a.register(ma)
        assert a.registered
        watched: asyncio.Queue[Event] = asyncio.Queue()
        pump = asyncio.create_task(_pump(observer.watch(), watched))

        snap = await _next(watched, ma.id)
        assert snap.kind == Event.KIND_SNAPSHOT and snap.member == ma
        await b.register(mb)
        assert (await _next(watched, mb.id)).kind == Event.KIND_JOINED
        assert (await _next(on_nats, ma.id)).kind == Event.KIND_JOINED
        assert (await _next(on_nats, mb.id)).kind == Event.KIND_JOINED
        assert await a.list(pb.ROLE_DECODE) == [mb]

        await a.close(deregister=False)  # heartbeats stop: the member must expire
        start = time.monotonic()
        left = await _next(watched, ma.id, timeout=TTL + 1)
        assert (left.kind, left.reason) == (Event.KIND_LEFT, "expired")
        assert time.monotonic() - start <= TTL + 1
        nats_left = await _next(on_nats, ma.id)
        assert (nats_left.kind, nats_left.reason) == (Event.KIND_LEFT, "expired")
        ids = [m.id for m in await b.list()]
        assert ma.id not in ids and mb.id in ids, "b's heartbeats keep it alive past the TTL"

        await b.close()
        left = await _next(watched, mb.id)
        assert (left.kind, left.reason) == (Event.KIND_LEFT, "deregistered")
        assert (await _next(on_nats, mb.id)).reason == "deregistered"
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await observer.register(pb.Member(role=pb.ROLE_DECODE))  # no id
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        pump.cancel()
        await observer.close()
        await bus.close()

    asyncio.run(main())


def test_client_outlives_a_dead_nameservice() -> None:
    """A client registering while the nameservice is down carries on and registers once it
    is up; SIGTERM stops the service with exit code 0 at once; the client and a watcher
    carry on and recover when a fresh instance is back on the same port, and the watcher
    never hears that the member left."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    flags = ("--port", str(port), "--ttl", str(TTL))

    async def main() -> None:
        client, observer = NameClient(address), NameClient(address)
        member = make_member(pb.ROLE_FUSED, "127.0.0.1:2001")
        await client.register(member)  # nothing listens yet: no exception
        assert not client.registered
        proc = spawn("nameservice", *flags)
        try:
            await asyncio.to_thread(wait_grpc, address, proc, 20)
            await eventually(lambda: client.registered, 3.0, "registered once it is up")
            watched: asyncio.Queue[Event] = asyncio.Queue()
            pump = asyncio.create_task(_pump(observer.watch(), watched))
            assert (await _next(watched, member.id)).kind == Event.KIND_SNAPSHOT

            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 5) == 0
            assert time.monotonic() - start < 3.0, "SIGTERM must stop the server promptly"
            await eventually(lambda: not client.registered, 3 * TTL, "outage noticed")
        finally:
            stop(proc)

        proc = spawn("nameservice", *flags)  # a fresh instance: it knows no one
        try:
            await asyncio.to_thread(wait_grpc, address, proc, 20)
            await eventually(lambda: client.registered, 3 * TTL, "registered again")
            assert member in await client.list()
            # Neither the outage (failed watch calls) nor the fresh instance's first
            # snapshot, held back until members had a TTL to register again, reads as the
            # member leaving: the watcher only sees it confirmed.
            back = await _next(watched, member.id, timeout=5.0)
            assert back.kind == Event.KIND_SNAPSHOT, _kinds([back])
            assert not pump.done()
            pump.cancel()
            await observer.close()
            await client.close()
        finally:
            assert stop(proc) == 0

    asyncio.run(main())


def test_service_modules_do_not_import_torch() -> None:
    code = (
        "import sys, rtp_serve.services.nameservice.main, rtp_serve.services.common.naming, "
        "rtp_serve.services.common.bus, rtp_serve.services.launcher.servers; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
