"""Many Generate streams over one call (rtp.v1.Worker/Streams), against worker processes
over real gRPC, read through the frontend's client (services/frontend/worker_streams.py):
the same tokens as a Generate call per request, fused and PD; a step's messages batched
into one reply; each request's errors, deadline and cancellation its own; a call that ends
ends its requests UNAVAILABLE; and a worker that does not say it has Streams served a Generate
call per request."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from rtp_serve.engine import SamplingParams
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.convert import params_to_pb
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from rtp_serve.services.common.pb import worker_pb2, worker_pb2_grpc
from rtp_serve.services.frontend.worker_streams import WorkerStreams
from tests.frontend_fakes import FakeWorker
from tests.procs import SMALL_WORKER, grpc_service, worker_roles
from tests.servers import eventually

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def workers(model_dir):
    with worker_roles(str(model_dir("tiny-llama"))) as addresses:
        yield addresses


def _request(rid: str, prompt, params=GREEDY, prefill: str = "") -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, params=params_to_pb(params),
        prefill_address=prefill,
    )  # fmt: skip


async def _own_call(address: str, request: worker_pb2.GenerateRequest) -> list[int]:
    async with grpc_util.channel(address) as ch:
        msgs = [m async for m in worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=30)]
    return [t for m in msgs for t in m.token_ids]


def _member(address: str, streams: bool = True) -> ns_pb2.Member:
    return ns_pb2.Member(id=address, address=address, streams=streams)


async def _shared(streams: WorkerStreams, address: str, request) -> list[int]:
    return [t async for m in streams.generate(_member(address), request, 30.0) for t in m.token_ids]


async def _idle(address: str) -> None:
    async def idle() -> bool:
        async with grpc_util.channel(address) as ch:
            stats = await worker_pb2_grpc.WorkerStub(ch).Stats(
                worker_pb2.WorkerStatsRequest(), timeout=10
            )
        return stats.num_running == 0 and stats.num_waiting == 0 and stats.held_blocks == 0

    await eventually(idle, 20.0, "the worker idle, no blocks held")


def test_requests_sharing_a_call_get_what_their_own_calls_get(workers, prompts, hf_greedy):
    async def main():
        channels = grpc_util.ChannelCache()
        streams = WorkerStreams(channels.get)
        try:
            fused = await asyncio.gather(
                *(_shared(streams, workers["fused"], _request(f"f{i}", p))
                  for i, p in enumerate(prompts))
            )  # fmt: skip
            pd = await asyncio.gather(
                *(_shared(streams, workers["decode"], _request(f"p{i}", p, prefill=workers["prefill"]))
                  for i, p in enumerate(prompts))
            )  # fmt: skip
            own = [await _own_call(workers["fused"], _request("o", prompts[0]))]
            assert len(streams._calls) == 2  # one call per worker, every request on it
        finally:
            await streams.close()
            await channels.close()
        return fused, pd, own

    fused, pd, own = asyncio.run(main())
    expected = [hf_greedy("tiny-llama", prompt, 10)[0] for prompt in prompts]
    assert fused == expected and pd == expected
    assert own[0] == fused[0]


def test_a_step_of_many_requests_is_one_reply(workers, prompts):
    async def main():
        async with grpc_util.channel(workers["fused"]) as ch:
            outgoing: asyncio.Queue = asyncio.Queue()

            async def requests():
                while (msg := await outgoing.get()) is not None:
                    yield msg

            call = worker_pb2_grpc.WorkerStub(ch).Streams(requests(), timeout=60)
            for i, p in enumerate(prompts):
                outgoing.put_nowait(worker_pb2.StreamsRequest(open=_request(f"s{i}", p)))
            ended: dict[str, int] = {}
            sizes = []
            async for reply in call:
                sizes.append(len(reply.outputs))
                for out in reply.outputs:
                    if not out.HasField("response"):
                        ended[out.request_id] = out.code
                if len(ended) == len(prompts):
                    break
            outgoing.put_nowait(None)
            call.cancel()
        return ended, sizes

    ended, sizes = asyncio.run(main())
    assert ended == {f"s{i}": 0 for i in range(len(prompts))}  # each ended OK
    assert max(sizes) >= len(prompts)  # a decode step's tokens of every request, together


def test_each_request_has_its_own_errors_deadline_and_cancel(workers, prompts):
    async def main():
        channels = grpc_util.ChannelCache()
        streams = WorkerStreams(channels.get)
        fused = workers["fused"]
        try:
            bad = _request("bad", prompts[0])
            bad.params.temperature = math.nan
            long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
            good, refused, slow = await asyncio.gather(
                _shared(streams, fused, _request("good", prompts[1])),
                _shared(streams, fused, bad),
                _deadline(streams, fused, _request("slow", prompts[2], long)),
                return_exceptions=True,
            )
            assert len(good) == 10  # a sibling's error is not this request's
            assert isinstance(refused, grpc.aio.AioRpcError)
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "temperature" in refused.details()
            assert isinstance(slow, grpc.aio.AioRpcError)
            assert slow.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await _idle(fused)  # the request past its deadline was stopped there

            # Read a few tokens and stop: the worker aborts the request, frees its blocks.
            messages = streams.generate(_member(fused), _request("stop", prompts[3], long), 30.0)
            for _ in range(3):
                await anext(messages)
            await messages.aclose()
            await _idle(fused)
            assert len(streams._calls) == 1  # all on the one call, still open
        finally:
            await streams.close()
            await channels.close()

    asyncio.run(main())


async def _deadline(streams: WorkerStreams, address: str, request) -> list[int]:
    return [t async for m in streams.generate(_member(address), request, 0.2) for t in m.token_ids]


def test_a_call_that_ends_ends_its_requests_unavailable(model_dir, prompts):
    async def main(address: str, proc) -> grpc.aio.AioRpcError:
        channels = grpc_util.ChannelCache()
        streams = WorkerStreams(channels.get)
        long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
        try:
            messages = streams.generate(_member(address), _request("r", prompts[0], long), 60.0)
            await anext(messages)
            proc.kill()
            with pytest.raises(grpc.aio.AioRpcError) as died:
                async for _ in messages:
                    pass
            assert not streams._calls  # the ended call left; the next request opens another
            return died.value
        finally:
            await streams.close()
            await channels.close()

    model = str(model_dir("tiny-llama"))
    with grpc_service("fused", "--model", model, *SMALL_WORKER) as (address, proc):
        error = asyncio.run(main(address, proc))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_a_worker_without_streams_gets_a_call_per_request():
    # A worker from before Streams registers without Member.streams: its requests go on
    # Generate calls of their own (this one has no Streams: the shared call would fail).
    async def main():
        worker = FakeWorker([5, 6, 7])
        server, port, _ = grpc_util.create_server("127.0.0.1:0")
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        await server.start()
        channels = grpc_util.ChannelCache()
        streams = WorkerStreams(channels.get)
        old = _member(f"127.0.0.1:{port}", streams=False)
        try:
            done = await asyncio.gather(
                *(_all(streams.generate(old, _request(rid, [1, 2, 3]), 10.0)) for rid in "abc")
            )
            assert all(msgs and msgs[-1].finished for msgs in done)
            assert sorted(r.request_id for r in worker.requests) == ["a", "b", "c"]
            assert not streams._calls
        finally:
            await streams.close()
            await channels.close()
            await server.stop(0)

    asyncio.run(main())


async def _all(messages) -> list:
    return [m async for m in messages]


def test_a_message_that_does_not_parse_ends_the_call_invalid_argument(workers, prompts):
    # A caller whose bytes are no StreamsRequest gets INVALID_ARGUMENT (not UNKNOWN, which
    # reads as a server bug); the worker serves the next caller as before.
    async def main():
        async with grpc_util.channel(workers["fused"]) as ch:
            raw = ch.stream_stream("/rtp.v1.Worker/Streams")

            async def garbage():
                yield b"\xff\xff\xff"

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in raw(garbage(), timeout=30):
                    pass
        channels = grpc_util.ChannelCache()
        streams = WorkerStreams(channels.get)
        try:
            served = await _shared(streams, workers["fused"], _request("after", prompts[0]))
        finally:
            await streams.close()
            await channels.close()
        return refused.value, served

    refused, served = asyncio.run(main())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
    assert len(served) == 10
