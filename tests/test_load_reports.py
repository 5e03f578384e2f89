"""A worker's load reports on NATS: an idle worker repeats an unchanged report only every
LOAD_KEEPALIVE_S (a thousand idle workers' reports were most of the master's idle CPU), a
change goes out at the next report interval, and the master counts both. The engine tells
the KV event feed when events wait; an idle feed neither looks nor takes.

Real parts: a nats-server process, a real engine (tiny-llama) behind AsyncLLM with its
event feed, and the master's ClusterView subscribed on NATS.
"""

from __future__ import annotations

import asyncio

from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.engine.async_llm import AsyncLLM
from rtp_serve.engine.config import EngineConfig
from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import events_pb2
from rtp_serve.services.common.pb import nameservice_pb2 as ns
from rtp_serve.services.master.cluster import LOAD_TTL_S, ClusterView
from rtp_serve.services.worker.kv_events import (
    LOAD_INTERVAL_S,
    LOAD_KEEPALIVE_S,
    KVEventFeed,
    publish_events,
)
from tests.servers import eventually

WORKER = "fused-0"


def test_keepalive_is_shorter_than_the_masters_ttl():
    # A keepalive lost: the next comes two keepalives after the last one counted (the
    # publisher sleeps until each is due), within the TTL, so the worker stays known.
    assert LOAD_INTERVAL_S < LOAD_KEEPALIVE_S
    assert 2 * LOAD_KEEPALIVE_S + 0.1 < LOAD_TTL_S


def test_idle_reports_are_keepalives_and_a_change_is_reported(model_dir, nats_server):
    async def main() -> None:
        llm = await asyncio.to_thread(
            AsyncLLM, EngineConfig(model=str(model_dir("tiny-llama")), num_kv_blocks=32), True
        )
        worker_bus = await Bus.connect(nats_server, WORKER)
        master_bus = await Bus.connect(nats_server, "master")
        view = ClusterView()
        view.apply_membership(
            ns.MembershipEvent(
                kind=ns.MembershipEvent.KIND_SNAPSHOT,
                member=ns.Member(id=WORKER, role=ns.ROLE_FUSED, address="127.0.0.1:1"),
            )
        )
        view.end_snapshot()
        reports: list[events_pb2.LoadReport] = []

        async def seen(msg: events_pb2.LoadReport, headers: dict[str, str]) -> None:
            reports.append(msg)

        await master_bus.subscribe(subjects.load_report(WORKER), events_pb2.LoadReport, seen)
        await view.subscribe(master_bus)
        await master_bus.flush()
        publisher = asyncio.create_task(
            publish_events(KVEventFeed(llm, worker_bus, WORKER), "default")
        )
        try:
            # Idle: the same report, each at least a keepalive after the one before.
            await eventually(lambda: len(reports) >= 4, timeout=30)
            idle = list(reports)
            said = {r.SerializeToString(deterministic=True) for r in _unstamped(idle)}
            assert len(said) == 1, "an idle worker's reports differ"
            gaps = [b.unix_ms - a.unix_ms for a, b in zip(idle, idle[1:], strict=False)]
            assert min(gaps) >= LOAD_KEEPALIVE_S * 1000 - 20, gaps
            assert view.load(WORKER) is not None

            # A request changes the load (new cached blocks, a fitted step): it is reported.
            before = len(reports)
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            async for _ in llm.generate(list(range(1, 40)), params, "r1"):
                pass
            await eventually(lambda: any(r.kv_seq != idle[-1].kv_seq for r in reports[before:]))
            changed = next(r for r in reports[before:] if r.kv_seq != idle[-1].kv_seq)
            assert changed.kv_seq > idle[-1].kv_seq
            counted = lambda: view.load(WORKER) or events_pb2.LoadReport()  # noqa: E731
            await eventually(lambda: counted().kv_seq == changed.kv_seq)
        finally:
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
            await worker_bus.close()
            await master_bus.close()
            await asyncio.to_thread(llm.shutdown)

    asyncio.run(main())


def test_an_idle_feed_takes_nothing_from_the_engine(model_dir, nats_server):
    # A flush with nothing pending must not stop the engine for a take (a call on the
    # engine thread, then a wakeup of the caller's loop, for nothing).
    async def main() -> None:
        llm = await asyncio.to_thread(
            AsyncLLM, EngineConfig(model=str(model_dir("tiny-llama")), num_kv_blocks=32), True
        )
        bus, listener, batches = await _worker_and_listener(nats_server)
        feed = KVEventFeed(llm, bus, WORKER)
        takes = 0
        take = llm.take_kv_events

        async def counted() -> list:
            nonlocal takes
            takes += 1
            return await take()

        llm.take_kv_events = counted  # type: ignore[method-assign]
        try:
            assert not llm.kv_events_pending()
            for _ in range(3):
                await feed.flush()
            assert takes == 0 and feed.seq == 0

            # A request's prompt fills two blocks: their stored events wait, and one flush
            # takes and publishes them.
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            async for _ in llm.generate(list(range(1, 40)), params, "r1"):
                pass
            await eventually(llm.kv_events_pending)
            await feed.flush()
            assert takes == 1 and feed.seq == 1
            await eventually(lambda: len(batches) == 1)
            assert len(batches[0].stored) >= 2
            assert not llm.kv_events_pending()
            await feed.flush()
            assert takes == 1 and feed.seq == 1

            # A snapshot still takes whatever is pending, in the same engine call.
            snap = await feed.snapshot()
            assert set(snap.block_hashes) == set(batches[0].stored)
        finally:
            await bus.close()
            await listener.close()
            await asyncio.to_thread(llm.shutdown)

    asyncio.run(main())


def test_the_engine_tells_the_feed_and_an_idle_feed_never_looks(model_dir, nats_server):
    # The engine tells its watcher that KV events wait, once until they are taken; the
    # publisher's feed then publishes them, and while nothing happens it does not look.
    async def main() -> None:
        llm = await asyncio.to_thread(
            AsyncLLM, EngineConfig(model=str(model_dir("tiny-llama")), num_kv_blocks=32), True
        )
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        told = 0

        def tell() -> None:
            nonlocal told
            told += 1

        try:
            # Events recorded before the watch are told at once.
            async for _ in llm.generate(list(range(1, 40)), params, "r0"):
                pass
            llm.watch_kv_events(tell)
            await eventually(lambda: told == 1)
            async for _ in llm.generate(list(range(40, 80)), params, "r1"):
                pass
            await asyncio.sleep(0.1)
            assert told == 1, "told again before the events were taken"
            assert await llm.take_kv_events()
            async for _ in llm.generate(list(range(80, 120)), params, "r2"):
                pass
            await eventually(lambda: told == 2)
            await llm.take_kv_events()

            bus, listener, batches = await _worker_and_listener(nats_server)
            looks = 0
            pending = llm.kv_events_pending

            def counted() -> bool:
                nonlocal looks
                looks += 1
                return pending()

            llm.kv_events_pending = counted  # type: ignore[method-assign]
            publisher = asyncio.create_task(
                publish_events(KVEventFeed(llm, bus, WORKER), "default")
            )
            try:
                await asyncio.sleep(1.0)  # idle: no look (it was 20 a second)
                assert looks == 0 and not batches
                async for _ in llm.generate(list(range(120, 160)), params, "r3"):
                    pass
                await eventually(lambda: len(batches) == 1)
                assert len(batches[0].stored) >= 2 and looks == 1
            finally:
                publisher.cancel()
                await asyncio.gather(publisher, return_exceptions=True)
                await bus.close()
                await listener.close()
        finally:
            await asyncio.to_thread(llm.shutdown)

    asyncio.run(main())


async def _worker_and_listener(nats_server: str) -> tuple[Bus, Bus, list[events_pb2.KVEvents]]:
    """The worker's bus, and a listener's with the KV event batches it has seen so far."""
    bus = await Bus.connect(nats_server, WORKER)
    batches: list[events_pb2.KVEvents] = []

    async def seen(msg: events_pb2.KVEvents, headers: dict[str, str]) -> None:
        batches.append(msg)

    listener = await Bus.connect(nats_server, "master")
    await listener.subscribe(subjects.kv_events(WORKER), events_pb2.KVEvents, seen)
    await listener.flush()
    return bus, listener, batches


def _unstamped(reports: list[events_pb2.LoadReport]) -> list[events_pb2.LoadReport]:
    out = []
    for r in reports:
        copy = events_pb2.LoadReport()
        copy.CopyFrom(r)
        copy.unix_ms = 0
        out.append(copy)
    return out
