"""The frontend's route batcher (services/frontend/route_batcher.py) against the real master
servicer over gRPC: routes that arrive while a call is in flight go as one RouteBatch and
are answered as the same Route calls one by one would be; each fails alone; a lone route is
a plain Route call; a master without RouteBatch gets Route calls; a route's own deadline
holds while its batch goes on."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.pb import master_pb2, master_pb2_grpc
from rtp_serve.services.frontend.route_batcher import RouteBatcher
from rtp_serve.services.master.policy import CacheAware
from rtp_serve.services.master.servicer import MasterServicer
from tests.frontend_fakes import serve_grpc
from tests.test_master import F, H, cluster, fitted, member

WORKERS = [member(f"f{i}", F) for i in range(6)]


def _view():
    queued = (0, 100, 200, 300, 400, 500)
    loads = [fitted(m.id, queued=q) for m, q in zip(WORKERS, queued, strict=True)]
    return cluster(*WORKERS, loads=loads, cached={"f3": H[:8]})


def _request(i: int, **fields) -> master_pb2.RouteRequest:
    fields = {"frontend_id": "fe"} | fields
    return master_pb2.RouteRequest(
        request_id=f"r{i}", block_hashes=H[: i % 9], num_prompt_tokens=160, **fields
    )


class Counting(MasterServicer):
    """The real servicer, counting the calls it answers."""

    def __init__(self, *args, delay_s: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []  # 1: a Route call; n: a RouteBatch of n
        self.releases: list[int] = []  # releases in each RouteBatch
        self.released: list[str] = []  # by Release calls
        self.delay_s = delay_s

    async def Release(self, request, context):
        self.released.append(request.request_id)
        return await super().Release(request, context)

    async def Route(self, request, context):
        self.calls.append(1)
        await asyncio.sleep(self.delay_s)
        return await super().Route(request, context)

    async def RouteBatch(self, request, context):
        self.calls.append(len(request.requests))
        self.releases.append(len(request.releases))
        await asyncio.sleep(self.delay_s)
        return await super().RouteBatch(request, context)


class OldMaster(Counting):
    """A master from before RouteBatch (the base class answers UNIMPLEMENTED)."""

    RouteBatch = master_pb2_grpc.MasterServicer.RouteBatch


async def _reached(master: Counting, n: int) -> None:
    """Until the master has taken its `n`th call (it is in flight for its delay)."""
    while len(master.calls) < n:
        await asyncio.sleep(0.001)


async def _serve(servicer):
    server, address = await serve_grpc(master_pb2_grpc.add_MasterServicer_to_server, servicer)
    channel = grpc_util.channel(address)
    return server, channel, RouteBatcher(lambda: master_pb2_grpc.MasterStub(channel))


async def _outcomes(batcher: RouteBatcher, requests, timeout=5.0) -> list:
    async def one(r):
        try:
            plan = await batcher.route(r, timeout)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return plan.decode.id, plan.matched_blocks, plan.reason

    return await asyncio.gather(*(one(r) for r in requests))


def test_a_burst_goes_as_batches_answered_as_route_calls_would_be():
    async def main():
        master = Counting(_view(), CacheAware(), delay_s=0.05)
        server, channel, batcher = await _serve(master)
        try:
            burst = [_request(i) for i in range(20)]
            burst[5].block_hashes[:] = [b"short"]  # refused alone: INVALID_ARGUMENT
            burst[7].request_id = "r6"  # r6's id, in flight for the same frontend: allowed
            burst[9].frontend_id = "other"  # ...
            burst[9].request_id = "r8"  # ...but r8's through another frontend: refused
            got = await _outcomes(batcher, burst)
            calls = list(master.calls)
            # One now, then nine while it is in flight: a Route call, then one RouteBatch.
            first = asyncio.create_task(_outcomes(batcher, [_request(40)]))
            await _reached(master, len(calls) + 1)
            rest = await _outcomes(batcher, [_request(41 + i) for i in range(9)])
            trickled = master.calls[len(calls) :]
            assert len(await first) == 1 and len(rest) == 9
            calls = list(master.calls)
            lone = await _outcomes(batcher, [_request(99)])
            after = master.calls[len(calls) :]
        finally:
            await channel.close()
            await server.stop(None)
        # The same requests, one Route call each, against the same view.
        reference = Counting(_view(), CacheAware())
        server, channel, one_by_one = await _serve(reference)
        try:
            expected = [(await _outcomes(one_by_one, [r]))[0] for r in burst]
        finally:
            await channel.close()
            await server.stop(None)
        return got, expected, calls[:1], trickled, lone, after, reference.calls

    got, expected, calls, trickled, lone, after, reference_calls = asyncio.run(main())
    assert got == expected
    assert reference_calls == [1] * 20
    # Asked in one go (before the batcher's first call started): one RouteBatch.
    assert calls == [20]
    assert trickled == [1, 9]
    assert got[5][0] == grpc.StatusCode.INVALID_ARGUMENT and "block_hashes[0]" in got[5][1]
    assert got[9][0] == grpc.StatusCode.ALREADY_EXISTS
    assert {g[0] for i, g in enumerate(got) if i not in (5, 9)} <= {m.id for m in WORKERS}
    assert after == [1] and lone[0][0] in {m.id for m in WORKERS}  # alone: a Route call


def test_a_master_without_route_batch_gets_route_calls():
    async def main():
        master = OldMaster(_view(), CacheAware(), delay_s=0.05)
        server, channel, batcher = await _serve(master)
        try:
            first = await _outcomes(batcher, [_request(i) for i in range(10)])
            again = await _outcomes(batcher, [_request(i) for i in range(10, 20)])
        finally:
            await channel.close()
            await server.stop(None)
        return first + again, master.calls

    got, calls = asyncio.run(main())
    assert all(g[0] in {m.id for m in WORKERS} for g in got)
    assert calls == [1] * 20  # after one RouteBatch refused (not counted), Route calls


@pytest.mark.parametrize("alone", [True, False])
def test_a_route_that_runs_out_of_time_fails_alone_and_the_call_goes_on(alone):
    async def main():
        master = Counting(_view(), CacheAware(), delay_s=0.5)
        server, channel, batcher = await _serve(master)
        try:
            blocker = asyncio.create_task(_outcomes(batcher, [_request(0)]))
            await _reached(master, 1)  # in flight: what comes now waits for it
            hasty = [_request(1)] if alone else [_request(1), _request(2)]
            short = await _outcomes(batcher, hasty, timeout=0.2)
            patient = await _outcomes(batcher, [_request(3)], timeout=5.0)
            return short, await blocker, patient, master.calls
        finally:
            await channel.close()
            await server.stop(None)

    short, blocked, patient, calls = asyncio.run(main())
    assert {s[0] for s in short} == {grpc.StatusCode.DEADLINE_EXCEEDED}
    assert blocked[0][0] in {m.id for m in WORKERS}
    assert patient[0][0] in {m.id for m in WORKERS}
    assert calls[0] == 1


def _ended(i: int, frontend="fe") -> master_pb2.ReleaseRequest:
    return master_pb2.ReleaseRequest(request_id=f"r{i}", frontend_id=frontend)


@pytest.mark.parametrize("old", [False, True])
def test_releases_go_at_once_when_idle_and_with_the_next_call_when_busy(old):
    async def main():
        master = (OldMaster if old else Counting)(_view(), CacheAware(), delay_s=0.05)
        server, channel, batcher = await _serve(master)
        try:
            await _outcomes(batcher, [_request(1)])
            await _outcomes(batcher, [_request(2)])
            taken = await _outcomes(batcher, [_request(1, frontend_id="other")])
            batcher.release(_ended(1))  # idle: goes at once, as a Release call
            await batcher.flush(5.0)
            retried = await _outcomes(batcher, [_request(1, frontend_id="other")])
            busy = asyncio.create_task(_outcomes(batcher, [_request(3)]))
            await _reached(master, len(master.calls) + 1)
            batcher.release(_ended(2))  # with the route that comes while one is in flight
            following = await _outcomes(batcher, [_request(4)])
            await busy
            await batcher.flush(5.0)
            calls, releases = list(master.calls), list(master.releases)
            checks = await _outcomes(batcher, [_request(i, frontend_id="other") for i in (2, 4)])
            return taken, retried, following, checks, calls, releases, master.released
        finally:
            await channel.close()
            await server.stop(None)

    taken, retried, following, checks, calls, releases, released = asyncio.run(main())
    assert taken[0][0] == grpc.StatusCode.ALREADY_EXISTS  # r1's lease held for "fe"
    assert retried[0][0] in {m.id for m in WORKERS}  # released: another frontend may
    assert following[0][0] in {m.id for m in WORKERS}
    assert checks[0][0] in {m.id for m in WORKERS}  # r2 was released
    assert checks[1][0] == grpc.StatusCode.ALREADY_EXISTS  # r4 was not
    if old:
        assert released == ["r1", "r2"]
    else:  # r1's release alone, as a Release call; r2's in r4's RouteBatch
        assert released == ["r1"] and releases == [1] and calls == [1, 1, 1, 1, 1, 1]


def test_a_send_that_breaks_fails_its_routes_as_unavailable():
    """Not a gRPC error (a closed channel, a bug): the routes fail at once as UNAVAILABLE
    (the frontend asks another master), and the next route is sent again."""
    broken = [True]

    def stub():
        if broken[0]:
            raise RuntimeError("the channel is closed")
        return master_pb2_grpc.MasterStub(channel)

    async def main():
        nonlocal channel
        server, channel, _ = await _serve(Counting(_view(), CacheAware()))
        batcher = RouteBatcher(stub)
        try:
            failed = await _outcomes(batcher, [_request(1), _request(2)])
            broken[0] = False
            return failed, await _outcomes(batcher, [_request(3)])
        finally:
            await channel.close()
            await server.stop(None)

    channel = None
    failed, answered = asyncio.run(main())
    assert [f[0] for f in failed] == [grpc.StatusCode.UNAVAILABLE] * 2
    assert "the channel is closed" in failed[0][1]
    assert answered[0][0] in {m.id for m in WORKERS}
