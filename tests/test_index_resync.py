"""The master's prefix index converges to what the workers hold, exactly, after a dropped
event batch, a worker restart, a master restart and a NATS restart under traffic.

Real parts throughout: a nats-server process, workers that are real engines (tiny-llama,
a small pool and a small host tier under it, so blocks are evicted from both) with their
event feed on NATS and the Worker gRPC service, and the master's ClusterView fetching
snapshots over gRPC. "What the workers hold" is the union of their Worker.Snapshot
replies; the check is set equality per worker and tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rtp_serve.core.model_config import ModelConfig
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.engine.async_llm import AsyncLLM
from rtp_serve.engine.config import EngineConfig
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import nameservice_pb2 as ns
from rtp_serve.services.common.pb import worker_pb2, worker_pb2_grpc
from rtp_serve.services.launcher.servers import free_port, start_nats
from rtp_serve.services.master.cluster import ClusterView, SnapshotClient
from rtp_serve.services.worker.kv_events import KVEventFeed, publish_events
from rtp_serve.services.worker.servicer import WorkerServicer
from tests.servers import eventually

NUM_KV_BLOCKS = 40  # 640 tokens: the traffic below evicts, so removals flow too
# A host tier (T1) of 24 tiny-llama blocks (32 KiB each in float32) under the pool: it fills
# and evicts too, and its entries must converge like the pool's.
HOST_KV_BYTES = 24 * 32 * 1024
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
Ev = ns.MembershipEvent


@dataclass
class Worker:
    """One worker in this process: engine, KV event feed + load on NATS, gRPC Snapshot."""

    worker_id: str
    llm: AsyncLLM
    bus: Bus
    feed: KVEventFeed
    server: object
    address: str
    publisher: asyncio.Task[None]

    @classmethod
    async def start(cls, model: str, worker_id: str, nats_url: str, port: int = 0) -> Worker:
        config = EngineConfig(
            model=model, num_kv_blocks=NUM_KV_BLOCKS, host_kv_cache_bytes=HOST_KV_BYTES
        )
        llm = await asyncio.to_thread(AsyncLLM, config, True)
        server, port, _ = grpc_util.create_server(f"127.0.0.1:{port}")
        servicer = WorkerServicer(llm)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        bus = await Bus.connect(nats_url, worker_id)
        feed = KVEventFeed(llm, bus, worker_id)
        servicer.serve_snapshots(feed)
        await server.start()
        publisher = asyncio.create_task(publish_events(feed, "default"))
        return cls(worker_id, llm, bus, feed, server, f"127.0.0.1:{port}", publisher)

    @property
    def member(self) -> ns.Member:
        return ns.Member(id=self.worker_id, role=ns.ROLE_FUSED, address=self.address)

    async def stop(self) -> None:
        self.publisher.cancel()
        await asyncio.gather(self.publisher, return_exceptions=True)
        await self.server.stop(0)
        await self.bus.close()
        await asyncio.to_thread(self.llm.shutdown)


@dataclass
class Master:
    """The master's cluster view, fed from NATS, resyncing over gRPC."""

    view: ClusterView
    bus: Bus
    fetch: SnapshotClient
    resync: asyncio.Task[None]

    @classmethod
    async def start(cls, nats_url: str, workers: list[Worker]) -> Master:
        view = ClusterView()
        # Membership first, as the nameservice Watch's snapshot: a batch that arrived before
        # it would make a worker "joined" instead of "startup", at random under traffic.
        for w in workers:
            view.apply_membership(Ev(kind=Ev.KIND_SNAPSHOT, member=w.member))
        view.end_snapshot()
        bus = await Bus.connect(nats_url, "master")
        await view.subscribe(bus)
        fetch = SnapshotClient(timeout_s=2.0)
        resync = asyncio.create_task(view.resync_forever(fetch))
        return cls(view, bus, fetch, resync)

    def index(self) -> dict[str, tuple[set[bytes], set[bytes]]]:
        """Each worker's entries: (its pool, its host tier)."""
        self.view.check_integrity()
        index = self.view.index
        return {w: (index.hashes(w), index.host.hashes(w)) for w in index.workers()}

    async def stop(self) -> None:
        self.resync.cancel()
        await asyncio.gather(self.resync, return_exceptions=True)
        await self.fetch.close()
        await self.bus.close()


async def truth(workers: list[Worker]) -> dict[str, tuple[set[bytes], set[bytes]]]:
    """The union of the workers' snapshots (pool, host tier), as their Snapshot RPC
    serves them."""
    out = {}
    for w in workers:
        async with grpc_util.channel(w.address) as ch:
            snap = await worker_pb2_grpc.WorkerStub(ch).Snapshot(
                worker_pb2.KVSnapshotRequest(), timeout=5
            )
        if snap.block_hashes or snap.host_block_hashes:
            out[w.worker_id] = (set(snap.block_hashes), set(snap.host_block_hashes))
    return out


async def converged(master: Master, workers: list[Worker], timeout: float = 10.0) -> None:
    async def equal() -> bool:
        return master.index() == await truth(workers)

    await eventually(equal, timeout, "index == union of worker snapshots")
    assert master.index(), "no traffic reached the index"


class Traffic:
    """Requests with shared prefixes (prefix hits) over many prefixes (evictions)."""

    def __init__(self, workers: list[Worker], vocab: int, seed: int = 0) -> None:
        self.workers = workers
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(vocab) for _ in range(48)] for _ in range(12)]
        self.vocab = vocab
        self.sent = 0

    async def one(self, worker: Worker | None = None) -> None:
        worker = worker or self.rng.choice(self.workers)
        prompt = self.rng.choice(self.prefixes) + [self.rng.randrange(self.vocab)] * 20
        self.sent += 1
        async for _ in worker.llm.generate(prompt, PARAMS, f"r{self.sent}"):
            pass

    async def burst(self, n: int) -> None:
        await asyncio.gather(*(self.one() for _ in range(n)))

    @contextlib.asynccontextmanager
    async def running(self, concurrency: int = 2) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                with contextlib.suppress(Exception):  # a worker being restarted
                    await self.one()

        tasks = [asyncio.create_task(loop()) for _ in range(concurrency)]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
def model(model_dir) -> str:
    return str(model_dir("tiny-llama"))


@contextlib.asynccontextmanager
async def cluster(model: str, nats_url: str, n: int = 2) -> AsyncIterator[tuple[list, Master]]:
    workers = [await Worker.start(model, f"fused-{i}", nats_url) for i in range(n)]
    master = await Master.start(nats_url, workers)
    try:
        yield workers, master
    finally:
        await master.stop()
        for w in workers:
            await w.stop()


def vocab(model: str) -> int:
    return ModelConfig.from_dir(model).vocab_size


def test_dropped_batches_are_repaired_by_gap_and_by_load_reports(model, nats_server):
    async def main() -> None:
        async with cluster(model, nats_server) as (workers, master):
            traffic = Traffic(workers, vocab(model))
            await traffic.burst(6)
            await converged(master, workers)
            stats = master.view.sync.stats
            assert stats.resyncs == {"startup": 2}
            w = workers[0]
            # Drop one batch (as a cut-off NATS connection does), then more traffic: the
            # next batch shows the hole.
            await drop_one_batch(w, traffic)
            await traffic.one(w)
            await converged(master, workers)
            assert stats.resyncs == {"startup": 2, "gap": 1}
            # Drop the last batch of a burst: no batch follows, the load reports tell.
            await drop_one_batch(w, traffic)
            await converged(master, workers)
            assert stats.resyncs == {"startup": 2, "gap": 1, "behind": 1}

    asyncio.run(main())


async def drop_one_batch(worker: Worker, traffic: Traffic) -> None:
    feed, bus = worker.feed, worker.feed.bus
    seq = feed.seq
    feed.bus = Bus(None, "dropping")  # publishes nothing, as a disconnected bus
    try:
        for _ in range(50):
            if feed.seq != seq:
                return
            await traffic.one(worker)
            await asyncio.sleep(0.06)
        raise AssertionError("no batch numbered while dropping")
    finally:
        feed.bus = bus


def test_worker_restart_under_the_same_id(model, nats_server):
    async def main() -> None:
        async with cluster(model, nats_server) as (workers, master):
            traffic = Traffic(workers, vocab(model))
            await traffic.burst(6)
            await converged(master, workers)
            old = workers[1]
            port = int(old.address.rsplit(":", 1)[1])
            await old.stop()
            workers[1] = await Worker.start(model, old.worker_id, nats_server, port)
            assert workers[1].feed.incarnation > old.feed.incarnation
            await traffic.burst(4)
            await converged(master, workers)
            assert master.view.sync.stats.resyncs["restart"] == 1
            assert master.view.sync.position(old.worker_id)[0] == workers[1].feed.incarnation

    asyncio.run(main())


def test_master_restart_starts_empty_and_resyncs(model, nats_server):
    async def main() -> None:
        async with cluster(model, nats_server) as (workers, master):
            traffic = Traffic(workers, vocab(model))
            await traffic.burst(6)
            await converged(master, workers)
            await master.stop()
            await traffic.burst(4)  # while no master listens
            fresh = await Master.start(nats_server, workers)
            try:
                await converged(fresh, workers)
                assert fresh.view.sync.stats.resyncs == {"startup": 2}
            finally:
                await fresh.stop()

    asyncio.run(main())


def test_nats_restart_under_traffic(model, tmp_path: Path):
    port = free_port()

    async def main() -> None:
        servers = [start_nats(tmp_path / "nats-1", port)]
        try:
            async with cluster(model, servers[0].url) as (workers, master):
                traffic = Traffic(workers, vocab(model))
                await traffic.burst(4)
                await converged(master, workers)
                buses = [master.bus, *(w.bus for w in workers)]
                async with traffic.running():
                    sent = traffic.sent
                    await eventually(lambda: traffic.sent >= sent + 3, 30, "traffic before")
                    servers[0].stop()  # every batch from here on is lost
                    sent = traffic.sent
                    await eventually(lambda: traffic.sent >= sent + 6, 30, "traffic in outage")
                    servers.append(start_nats(tmp_path / "nats-2", port))
                    await eventually(lambda: all(b.connected for b in buses), 10, "reconnect")
                    sent = traffic.sent
                    await eventually(lambda: traffic.sent >= sent + 6, 30, "traffic after")
                await converged(master, workers)
                resyncs = master.view.sync.stats.resyncs
                # The master's reconnect wants both; a gap seen first may have claimed one.
                assert resyncs["reconnect"] >= 1
                assert resyncs["reconnect"] + resyncs["gap"] + resyncs["behind"] >= 2
        finally:
            for server in servers:
                server.stop()

    asyncio.run(main())
