"""Two master replicas share their route charges over real NATS (charge_exchange.py): each
charges the other's routes as its own, its own once, and for the same request the two
then choose the same worker even though each routed only part of the traffic."""

from __future__ import annotations

import asyncio

from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import master_pb2
from rtp_serve.services.master.charge_exchange import ChargeExchange
from rtp_serve.services.master.cluster import ClusterView
from rtp_serve.services.master.policy import CacheAware
from tests.servers import eventually
from tests.test_master import F, H, cluster, load, member

WORKERS = [member(f"f{i}", F) for i in range(8)]


def _view() -> ClusterView:
    # Every worker idle and reporting: each route is a tie the charges alone break.
    return cluster(*WORKERS, loads=[load(m.id) for m in WORKERS])


def _pending(view: ClusterView) -> dict[str, tuple[int, int]]:
    return {m.id: (p.requests, p.tokens) for m in WORKERS if (p := view.pending(m.id)).requests}


def _request(i: int) -> master_pb2.RouteRequest:
    return master_pb2.RouteRequest(request_id=f"r{i}", block_hashes=H[:4], num_prompt_tokens=64)


def test_replicas_charge_each_others_routes_and_agree(nats_server):
    asyncio.run(_exchange(nats_server))


async def _exchange(url: str) -> None:
    views = [_view(), _view()]
    buses = [await Bus.connect(url, f"master-{i}") for i in range(2)]
    exchanges = [ChargeExchange(v, b, f"master-{i}", "charges") for i, (v, b) in
                 enumerate(zip(views, buses, strict=True))]  # fmt: skip
    try:
        for x in exchanges:
            await x.subscribe()
        for b in buses:
            await b.flush()
        policy = CacheAware()
        for i in range(6):  # the frontend alternates between the replicas
            view, exchange = views[i % 2], exchanges[i % 2]
            policy.route(view, _request(i))
            await exchange.publish_routed()
            # Requests further apart than the publishing delay (milliseconds here).
            await eventually(lambda: _pending(views[0]) == _pending(views[1]), 5.0, "agree")
        assert sum(n for n, _ in _pending(views[0]).values()) == 6  # no echo charged twice
        assert len(_pending(views[0])) == 6  # each replica saw the other's charges
        # The next request, asked of both: the same worker, one none of the six went to.
        charged = _pending(views[0])
        plans = [policy.route(v, _request(99)) for v in views]
        assert plans[0].decode.id == plans[1].decode.id
        assert plans[0].decode.id not in charged
    finally:
        for b in buses:
            await b.close()


def test_a_master_alone_keeps_no_outbox():
    view = _view()
    CacheAware().route(view, _request(0))
    assert view.take_routed() == []  # not shared: nothing kept
