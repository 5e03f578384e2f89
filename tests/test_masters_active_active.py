"""Two masters, active-active: both follow the same event stream, the frontend spreads its
routes over them and, when one fails, moves to the other before routing by itself; a
request's lease is released at the master that routed it."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from rtp_serve.services.common.pb import master_pb2, master_pb2_grpc
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from rtp_serve.services.frontend.router_client import Router, master_list
from rtp_serve.services.launcher.servers import free_port
from tests.frontend_fakes import FakeMaster, serve_grpc
from tests.procs import grpc_service, spawn, stop
from tests.servers import eventually
from tests.test_sim_worker import _members, _wait_members, sim_workers

NAMESPACE = "active-active"


def test_master_list_parses_a_comma_separated_flag() -> None:
    assert master_list(None) == () and master_list("") == ()
    assert master_list("a:1, b:2,") == ("a:1", "b:2")
    assert master_list(["a:1"]) == ("a:1",)


def test_routes_spread_over_masters_and_move_when_one_dies() -> None:
    async def main():
        worker = ns_pb2.Member(id="w1", role=ns_pb2.ROLE_FUSED, address="127.0.0.1:1")
        masters, servers, addresses = [], [], []
        for _ in range(2):
            m = FakeMaster([("w1", None)])
            m.members = {"w1": worker}
            server, address = await serve_grpc(master_pb2_grpc.add_MasterServicer_to_server, m)
            masters.append(m)
            servers.append(server)
            addresses.append(address)

        async def watch() -> AsyncIterator[ns_pb2.MembershipEvent]:
            yield ns_pb2.MembershipEvent(kind=ns_pb2.MembershipEvent.KIND_SNAPSHOT, member=worker)
            await asyncio.Event().wait()

        router = Router(",".join(addresses), watch)
        await router.start()
        try:
            ids = [f"r{i}" for i in range(40)]
            for rid in ids:
                route = await router.route(master_pb2.RouteRequest(request_id=rid))
                assert route.source == "master"
            first = [{r.request_id for r in m.requests} for m in masters]
            assert first[0] and first[1] and first[0] | first[1] == set(ids)  # spread
            # The same id asks the same master again (a migration keeps its lease there).
            await router.route(master_pb2.RouteRequest(request_id=ids[0]))
            assert [m.requests[-1].request_id for m in masters].count(ids[0]) == 1
            for rid in ids:
                router.release(rid)
            await router.flush(5.0)  # the releases go in the background
            assert [{r for r, _ in m.released} for m in masters] == first

            await servers[0].stop(grace=None)  # master 0 dies: its share moves to master 1
            for m in masters:
                m.requests.clear()
            for rid in ids:
                route = await router.route(master_pb2.RouteRequest(request_id=rid))
                assert route.source == "master", rid
            assert {r.request_id for r in masters[1].requests} == set(ids)
        finally:
            await router.close()
            for server in servers:
                await server.stop(grace=None)

    asyncio.run(main())


# -- real processes -----------------------------------------------------------------------
def _scrape(address: str) -> str:
    return httpx.get(f"http://{address}/metrics", timeout=10).text


def _counter(text: str, family: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == family + "_total" and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_sigkill_one_master_under_load_fails_no_request(model_dir, nats_server) -> None:
    """Nameservice, two masters, four simulated workers and a frontend that knows the
    masters from the nameservice. Streams run while one master is SIGKILLed: every request
    completes, none is routed by the frontend's fallback, and the survivor's route counter
    counts every request after the kill."""
    model = str(model_dir("tiny-llama"))
    space = ("--nats-url", nats_server, "--namespace", NAMESPACE)
    # TTL 3 s: on a busy machine a 1 s TTL forgets live members (masters among them).
    with grpc_service("nameservice", "--ttl", "3", *space) as (ns, _):
        # As deployed (deploy/k8s/master.yaml): the replicas route on the same events.
        m_flags = ("--nameservice", ns, "--event-cutoff-ms", "50", *space)
        with (
            grpc_service("master", *m_flags) as (a, proc_a),
            grpc_service("master", *m_flags) as (b, _),
            sim_workers(ns, nats_server, "fused", 4, "--model", model, "--namespace", NAMESPACE),
        ):
            asyncio.run(_wait_members(ns, ns_pb2.ROLE_FUSED, 4))
            masters = {m.address: m for m in asyncio.run(_members(ns, ns_pb2.ROLE_MASTER))}
            assert set(masters) == {a, b}
            port = free_port()
            frontend = spawn("frontend", "--nameservice", ns, "--model", model, "--port",
                             str(port), "--namespace", NAMESPACE)  # fmt: skip
            try:
                asyncio.run(_kill_one_under_load(port, model, proc_a, masters[a], masters[b]))
            finally:
                stop(frontend)


async def _kill_one_under_load(port: int, model: str, victim, dead, survivor) -> None:
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:

        async def ready() -> bool:
            try:
                return (await http.get("/ready")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(ready, 60.0, "the frontend is ready")

        async def one(i: int) -> tuple[int, int]:
            """Status and output tokens of one stream (simulated workers emit no EOS)."""
            body = {"model": Path(model).name, "prompt": list(range(i, i + 40)),
                    "max_tokens": 300, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            tokens = 0
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data: {") and '"usage": {' in line:
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                return reply.status_code, tokens

        before = [asyncio.create_task(one(i)) for i in range(16)]  # streams in flight

        async def routed() -> bool:
            text = await asyncio.to_thread(_scrape, f"127.0.0.1:{port}")
            return _counter(text, "rtp:routes", source="master") >= len(before)

        await eventually(routed, 30.0, "the first streams routed")
        routed_before = await asyncio.to_thread(_scrape, survivor.metrics_address)
        by_dead = await asyncio.to_thread(_scrape, dead.metrics_address)
        assert _counter(by_dead, "rtp:route_decisions") > 0  # both masters had a share
        assert _counter(routed_before, "rtp:route_decisions") > 0
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        after = []
        for i in range(16):  # new requests while the dead master is still a member
            after.append(asyncio.create_task(one(100 + i)))
            await asyncio.sleep(0.05)
        results = await asyncio.gather(*before, *after)
    assert all(status == 200 for status, _ in results), results
    assert all(tokens == 300 for _, tokens in results), results
    metrics = await asyncio.to_thread(_scrape, f"127.0.0.1:{port}")
    assert _counter(metrics, "rtp:routes", source="fallback") == 0
    assert _counter(metrics, "rtp:routes", source="master") == 32
    survived = await asyncio.to_thread(_scrape, survivor.metrics_address)
    gained = _counter(survived, "rtp:route_decisions") - _counter(
        routed_before, "rtp:route_decisions"
    )
    assert gained >= len(after)
