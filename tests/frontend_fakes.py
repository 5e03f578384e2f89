"""Scripted gRPC workers and master, and a harness that serves the frontend's HTTP app over
them: the frontend's own logic (routing, retries, detokenizing, SSE, cancellation) tested
without a model. Real workers are exercised by the cluster tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from aiohttp.test_utils import TestClient, TestServer

from rtp_serve.core.block_hash import model_fingerprint
from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.kv_namespace import KVNamespace
from rtp_serve.services.common.pb import (
    common_pb2,
    master_pb2,
    master_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from rtp_serve.services.frontend.adapters import Adapters
from rtp_serve.services.frontend.auth import ApiKeys
from rtp_serve.services.frontend.generation import DEFAULT_MAX_MIGRATIONS, Generator
from rtp_serve.services.frontend.http_api import build_app, server_options
from rtp_serve.services.frontend.limits import Limits
from rtp_serve.services.frontend.model_info import ModelInfo
from rtp_serve.services.frontend.router_client import Router

TIMEOUT_S = 20.0
CACHED = 16  # num_cached_tokens every fake worker reports


def run(coro) -> object:
    """Run a test coroutine on a fresh loop, bounded."""
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Streams `script` one token per message, continuing it after the part of the script a
    resumed prompt already holds (prompt = base prompt + script[:k]).

    `fail`: status codes for successive calls, each raised after `fail_after` tokens.
    `eos`: when the script runs out, finish with this stop token; else cycle to max_tokens.
    """

    def __init__(
        self,
        script: Sequence[int],
        fail: Sequence[grpc.StatusCode] = (),
        fail_after: int = 0,
        eos: int | None = None,
        delay: float = 0.0,
        base_prompt_len: int | None = None,
        per_message: int = 1,
        blame_prefill: bool = False,
        logprob_by_seed: bool = False,
        first_split: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """`per_message`: tokens sent together, as a speculating worker does.
        `blame_prefill`: a scripted failure names the request's prefill worker as the peer
        that failed (as a decode worker whose prefill worker died does).
        `logprob_by_seed`: every sampled token's logprob is -0.5 - (seed % 7) / 10, so
        sequences with different seeds rank differently."""
        self.blame_prefill = blame_prefill
        self.first_split = first_split  # (queue_s, prefill_s) on the first message
        self.logprob_by_seed = logprob_by_seed
        self.script = list(script)
        self.per_message = per_message
        self.fail = list(fail)
        self.fail_after = fail_after
        self.eos = eos
        self.delay = delay
        self.base_prompt_len = base_prompt_len
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):
        self.requests.append(request)
        fail = self.fail.pop(0) if self.fail else None
        params = request.params
        start = 0
        msg: worker_pb2.GenerateResponse | None = None
        if self.base_prompt_len is not None:
            start = len(request.prompt_token_ids) - self.base_prompt_len
        try:
            for i in range(params.max_tokens):
                if fail is not None and i == self.fail_after:
                    if self.blame_prefill:
                        peer = ((grpc_util.FAILED_PEER_KEY, request.prefill_address),)
                        context.set_trailing_metadata(peer)
                    await context.abort(fail, "scripted failure")
                pos = start + i
                last = i == params.max_tokens - 1
                if self.eos is not None and pos >= len(self.script):
                    token, reason = self.eos, "stop"
                else:
                    token, reason = self.script[pos % len(self.script)], "length" if last else ""
                if msg is None:
                    msg = worker_pb2.GenerateResponse(
                        num_prompt_tokens=len(request.prompt_token_ids),
                        num_cached_tokens=CACHED,
                    )
                    if i == 0:
                        msg.queue_s, msg.prefill_s = self.first_split
                msg.token_ids.append(token)
                msg.finished, msg.finish_reason = bool(reason), reason
                if reason == "stop":
                    msg.stop_reason = token
                if params.HasField("logprobs"):
                    top = [
                        common_pb2.TopLogprob(token_id=token + j, logprob=-1.0 - j)
                        for j in range(params.logprobs)
                    ]
                    lp = -0.5 - (params.seed % 7) / 10 if self.logprob_by_seed else -0.5
                    msg.logprobs.append(
                        common_pb2.TokenLogprob(token_id=token, logprob=lp, top=top)
                    )
                if not reason and len(msg.token_ids) < self.per_message:
                    continue
                yield msg
                msg = None
                if reason:
                    return
                if self.delay:
                    await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


class FakeMaster(master_pb2_grpc.MasterServicer):
    """Answers with the first of `routes` ((decode id, prefill id or None)) whose decode
    worker is not excluded; the harness fills in `members`."""

    def __init__(
        self, routes: Sequence[tuple[str, str | None]] = (), fail=None, **prediction: float
    ) -> None:
        """`prediction`: RoutePlan fields every plan carries (predicted_ttft_s, ...)."""
        self.prediction = prediction
        self.routes = list(routes)
        self.fail = fail
        self.members: dict[str, ns_pb2.Member] = {}
        self.requests: list[master_pb2.RouteRequest] = []
        self.released: list[tuple[str, str]] = []  # (request id, frontend id)

    async def Release(self, request, context):
        self.released.append((request.request_id, request.frontend_id))
        return master_pb2.ReleaseReply(released=True)

    async def Route(self, request, context):
        self.requests.append(request)
        if self.fail is not None:
            await context.abort(self.fail, "scripted master failure")
        for decode, prefill in self.routes:
            if decode not in request.exclude and prefill not in request.exclude:
                plan = master_pb2.RoutePlan(
                    decode=self.members[decode], policy="fake", **self.prediction
                )
                if prefill is not None:
                    plan.prefill.CopyFrom(self.members[prefill])
                return plan
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no workers")


@dataclass
class Harness:
    client: TestClient
    generator: Generator
    members: dict[str, ns_pb2.Member] = field(default_factory=dict)
    servers: list[grpc.aio.Server] = field(default_factory=list)


async def serve_grpc(add, servicer) -> tuple[grpc.aio.Server, str]:
    server, port, _ = grpc_util.create_server("127.0.0.1:0")
    add(servicer, server)
    await server.start()
    return server, f"127.0.0.1:{port}"


def kv_namespace(model_dir: Path, block_size: int = 16) -> KVNamespace:
    """The KV namespace a float32 worker of `model_dir` registers (worker/serve.py)."""
    return KVNamespace(block_size, model_fingerprint(model_dir).hex(), "float32")


@contextlib.asynccontextmanager
async def frontend(
    model_dir: Path,
    workers: dict[str, tuple[int, FakeWorker]],  # id -> (role, worker)
    master: FakeMaster | None = None,
    master_address: str | None = None,
    max_concurrent: int = 256,
    max_migrations: int = DEFAULT_MAX_MIGRATIONS,
    limits: Limits | None = None,
    keys: ApiKeys | None = None,
    lora_root: Path | None = None,
) -> AsyncIterator[Harness]:
    """The HTTP app over fake workers (known from a fake nameservice watch) and master;
    `keys` and `lora_root` as the frontend's auth flags and --lora-root give them."""
    servers, members = [], {}
    try:
        for wid, (role, worker) in workers.items():
            server, address = await serve_grpc(worker_pb2_grpc.add_WorkerServicer_to_server, worker)
            servers.append(server)
            member = ns_pb2.Member(id=wid, role=role, address=address)
            members[wid] = kv_namespace(model_dir).stamp(member)  # as a worker registers
        if master is not None:
            master.members = members
            server, master_address = await serve_grpc(
                master_pb2_grpc.add_MasterServicer_to_server, master
            )
            servers.append(server)

        async def watch() -> AsyncIterator[ns_pb2.MembershipEvent]:
            for m in members.values():
                yield ns_pb2.MembershipEvent(kind=ns_pb2.MembershipEvent.KIND_SNAPSHOT, member=m)
            await asyncio.Event().wait()

        router = Router(master_address, watch if members else None)
        await router.start()
        while len(router.membership.members) < len(members):
            await asyncio.sleep(0)
        model = ModelInfo.load(str(model_dir))
        gen = Generator(
            model,
            Tokenizer(model_dir),
            router,
            max_concurrent=max_concurrent,
            limits=limits,
            max_migrations=max_migrations,
            adapters=Adapters(lora_root),
            tenants=keys.tenants if keys is not None else None,
        )
        server = TestServer(build_app(gen, keys))
        await server.start_server(**server_options(gen.limits))  # (not taken by __init__)
        async with TestClient(server) as client:
            yield Harness(client, gen, members, servers)
        await router.close()
    finally:
        for server in servers:
            await server.stop(grace=None)


async def sse_events(resp) -> list[object]:
    """The data payloads of an SSE response, "[DONE]" included as a string."""
    import json

    events = []
    async for line in resp.content:
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
