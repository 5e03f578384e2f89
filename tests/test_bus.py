"""The typed NATS bus against a real nats-server: typed round trips, failing handlers,
NATS down at start, NATS restarted under a live subscription, and the disabled bus."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import nats as nats_py

from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import events_pb2
from rtp_serve.services.launcher.servers import free_port
from tests.servers import eventually, nats

Report = events_pb2.LoadReport


def _subject() -> str:
    """A subject no other test uses (the NATS server is shared by the session)."""
    return subjects.load_report(f"w{uuid.uuid4().hex[:8]}", namespace="bustest")


async def _collect(bus: Bus, subject: str) -> asyncio.Queue[tuple[Report, dict[str, str]]]:
    got: asyncio.Queue[tuple[Report, dict[str, str]]] = asyncio.Queue()

    async def handler(msg: Report, headers: dict[str, str]) -> None:
        await got.put((msg, headers))

    await bus.subscribe(subject, Report, handler)
    return got


def test_typed_round_trip_with_headers(nats_server: str) -> None:
    async def main() -> None:
        sub, pub = await Bus.connect(nats_server, "sub"), await Bus.connect(nats_server, "pub")
        assert sub.connected and pub.connected
        subject = _subject()
        got = await _collect(sub, subject)
        sent = Report(worker_id="w1", num_running=3, free_blocks=7, unix_ms=123)
        await pub.publish(subject, sent, headers={"traceparent": "00-abc-def-01"})
        msg, headers = await asyncio.wait_for(got.get(), 5)
        assert isinstance(msg, Report) and msg == sent
        assert headers == {"traceparent": "00-abc-def-01"}
        assert pub.published == 1 and pub.dropped == 0
        await sub.close()
        await pub.close()

    asyncio.run(main())


def test_failing_handler_and_bad_payload_keep_the_subscription(nats_server: str) -> None:
    async def main() -> None:
        bus = await Bus.connect(nats_server, "t")
        subject = _subject()
        seen: list[int] = []

        async def handler(msg: Report, headers: dict[str, str]) -> None:
            seen.append(msg.num_waiting)
            if msg.num_waiting == 1:
                raise RuntimeError("handler bug")

        await bus.subscribe(subject, Report, handler)
        raw = await nats_py.connect(nats_server)  # a foreign publisher sending junk
        await raw.publish(subject, b"\x0a\xff")
        await raw.flush()
        await raw.close()
        for n in (1, 2):
            await bus.publish(subject, Report(num_waiting=n))
        await eventually(lambda: seen == [1, 2], 5, "both messages handled")
        await bus.close()

    asyncio.run(main())


def test_disabled_bus_is_a_no_op() -> None:
    async def main() -> None:
        bus = await Bus.connect(None, "t")
        assert not bus.enabled and not bus.connected
        await bus.subscribe(_subject(), Report, _never)
        await bus.publish(_subject(), Report())
        assert bus.published == 0 and bus.dropped == 0
        await bus.close()

    asyncio.run(main())


async def _never(msg: Report, headers: dict[str, str]) -> None:
    raise AssertionError("a disabled bus delivered a message")


def test_nats_down_at_start_then_restarted(tmp_path: Path) -> None:
    """Connect and subscribe while NATS is down; deliver once it is up; drop (never raise)
    while it is down again; deliver again after it is back on the same port."""
    port = free_port()

    async def deliver(pub: Bus, got: asyncio.Queue, subject: str, n: int) -> None:
        # Until the subscriber's SUB is replayed after a reconnect, a message can go nowhere.
        async def arrived() -> bool:
            await pub.publish(subject, Report(num_running=n))
            await pub.flush()
            return not got.empty()

        await eventually(arrived, 5, f"delivery {n}")
        await pub.flush()
        await asyncio.sleep(0.05)  # let retried duplicates land before draining
        while not got.empty():
            assert (await got.get())[0].num_running == n

    async def main() -> None:
        url = f"nats://127.0.0.1:{port}"
        start = time.monotonic()
        sub, pub = await Bus.connect(url, "sub"), await Bus.connect(url, "pub")
        assert time.monotonic() - start < 1.5, "connect must not wait for a dead NATS"
        assert not sub.connected
        subject = _subject()
        got = await _collect(sub, subject)
        await pub.publish(subject, Report(num_running=0))  # dropped, not raised
        assert pub.dropped == 1

        with nats(tmp_path, port):
            await eventually(lambda: sub.connected and pub.connected, 5, "first connect")
            await deliver(pub, got, subject, 1)
        await eventually(lambda: not pub.connected, 5, "disconnect noticed")
        dropped = pub.dropped
        await pub.publish(subject, Report(num_running=99))
        assert pub.dropped == dropped + 1

        with nats(tmp_path, port):
            await eventually(lambda: sub.connected and pub.connected, 5, "reconnect")
            await deliver(pub, got, subject, 2)
            await sub.close()
            await pub.close()

    asyncio.run(main())
