"""Master replicas with an event cutoff (services/master/held_events.py): each counts every
event from its stamp, and routes a request on the events stamped before the request's stamp
less the cutoff, so two replicas that received the same events in other orders and at other
moments (each within the cutoff) choose the same workers."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import events_pb2, master_pb2
from rtp_serve.services.launcher.servers import free_port
from rtp_serve.services.master.cluster import ClusterView
from rtp_serve.services.master.policy import CacheAware
from tests.procs import grpc_service
from tests.servers import eventually
from tests.test_master import PD3, Ev, F, H, fitted, kv, member
from tests.test_metrics import scrape, total

CUTOFF_S = 0.05
T0 = 1_800_000_000.0  # unix s


@dataclass
class Replica:
    """A master's view with its own wall clock, which the test moves to each arrival."""

    cutoff_s: float
    wall: list[float] = field(default_factory=lambda: [T0])
    view: ClusterView = field(init=False)

    def __post_init__(self) -> None:
        self.view = ClusterView(event_cutoff_s=self.cutoff_s, wall=lambda: self.wall[0])


def _ms(t: float) -> int:
    return round(t * 1000)


def _request(i: int, at: float, hashes=()) -> master_pb2.RouteRequest:
    return master_pb2.RouteRequest(
        request_id=f"r{i}", block_hashes=hashes, num_prompt_tokens=200, unix_ms=_ms(at)
    )


def _pending(view: ClusterView, ids) -> dict[str, int]:
    return {w: p.requests for w in ids if (p := view.pending(w)).requests}


def test_events_count_from_their_stamps_and_a_route_counts_those_before_its_own():
    a = Replica(CUTOFF_S)
    view = a.view
    for w in ("w0", "w1"):
        view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=member(w, F)))
    a.wall[0] = T0 + 1.0
    view.apply_load(fitted("w0", unix_ms=_ms(T0 + 0.99)))
    view.apply_load(fitted("w1", queued=5000, unix_ms=_ms(T0 + 0.99)))
    view.apply_kv_events(kv("w1", stored=H[:6], published_unix_ns=int((T0 + 0.995) * 1e9)))
    assert view.load("w0") is None and view.index.match("w1", H[:6]) == 0  # held
    # A request stamped 52 ms after the reports counts them, not the KV batch 5 ms later.
    first = CacheAware().route(view, _request(0, T0 + 1.042, H[:6]))
    assert view.load("w1").queued_tokens == 5000 and view.index.match("w1", H[:6]) == 0
    assert first.decode.id == "w0"  # w1's queue, and no prefix there as of the cut
    assert _pending(view, ("w0", "w1")) == {}  # its own charge counts from its stamp too
    second = CacheAware().route(view, _request(1, T0 + 1.1, H[:6]))
    assert view.index.match("w1", H[:6]) == 6 and _pending(view, ("w0", "w1")) == {"w0": 1}
    assert second.decode.id == "w0"  # the prefix saves less than w1's queue costs
    # A report stamped before the one counted is dropped when it comes due.
    a.wall[0] = T0 + 1.3
    view.apply_load(fitted("w1", queued=0, unix_ms=_ms(T0 + 0.98)))
    view.catch_up(_ms(T0 + 1.3))
    assert view.load("w1").queued_tokens == 5000
    # Load TTL and charge expiry count from stamps: a second on, the reports are stale.
    a.wall[0] = T0 + 2.2
    view.catch_up(_ms(T0 + 2.2))
    assert view.load("w0") is None and _pending(view, ("w0", "w1")) == {"w0": 2}
    a.wall[0] = T0 + 3.2
    view.catch_up(_ms(T0 + 3.2))
    assert _pending(view, ("w0", "w1")) == {}
    view.check_integrity()


def test_a_charge_held_for_a_worker_that_left_is_dropped():
    a = Replica(CUTOFF_S)
    view = a.view
    view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=member("w0", F)))
    view.charge("w0", 100, unix_ms=_ms(T0 + 0.5), here=False)
    view.apply_membership(Ev(kind=Ev.KIND_LEFT, member=member("w0", F)))
    view.catch_up(_ms(T0 + 1.0))
    assert view.pending("w0").requests == 0
    view.check_integrity()


def _replay(cutoff_s: float, seed: int, members) -> tuple[list[list[tuple[str, str]]], list]:
    """One random cluster history (load reports, KV batches, requests), delivered to two
    replicas each with its own delays: every route's choice on each, and what each view
    holds at the end. (Requests that reach a replica out of the order of their stamps move
    its cut by the later one: `ClusterView.catch_up`.)"""
    rng = random.Random(seed)
    ids = [m.id for m in members]
    events: list[tuple[float, str, object]] = []  # (stamp, kind, payload)
    for w in ids:
        t = rng.uniform(0, 0.25)
        while t < 3.0:
            report = fitted(w, token_ms=1.0, queued=rng.choice([0, 0, 200, 800, 3000]),
                            running=rng.randrange(4), unix_ms=_ms(T0 + t))  # fmt: skip
            events.append((t, "load", report))
            if rng.random() < 0.5:
                hashes = H[: rng.randrange(1, 9)]
                gone = rng.random() < 0.3
                batch = kv(w, published_unix_ns=int((T0 + t) * 1e9))
                (batch.removed if gone else batch.stored).extend(hashes)
                events.append((t + 0.001, "kv", batch))
            t += rng.uniform(0.2, 0.3)
    for i in range(60):
        t = 0.5 + i * 0.04 + rng.uniform(0, 0.01)
        events.append((t, "route", _request(i, T0 + t, H[: rng.randrange(0, 9)])))
    replicas = [Replica(cutoff_s) for _ in range(2)]
    choices: list[list[tuple[str, str]]] = []
    for r in replicas:
        for m in members:
            r.view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=m))
        # Events take up to 80% of the cutoff to arrive; requests up to 5 ms, in order.
        late = [
            (t + rng.uniform(0, 0.005 if kind == "route" else 0.8 * CUTOFF_S), kind, e)
            for t, kind, e in events
        ]
        mine: list[tuple[str, str]] = []
        policy = CacheAware()
        for at, kind, e in sorted(late, key=lambda x: x[0]):
            r.wall[0] = T0 + at
            if kind == "load":
                r.view.apply_load(e)
            elif kind == "kv":
                r.view.apply_kv_events(e)
            else:
                plan = policy.route(r.view, e)
                mine.append((plan.prefill.id, plan.decode.id))
        r.wall[0] = T0 + 3.2
        r.view.catch_up(_ms(T0 + 3.1))  # one moment on both, after every event
        r.view.check_integrity()
        choices.append(mine)
    held = [
        (
            {w: (v.load(w) or events_pb2.LoadReport()).unix_ms for w in ids},
            {w: (p.requests, p.tokens, p.blocks) for w in ids if (p := v.pending(w)).requests},
            {w: sorted(v.index.hashes(w)) for w in ids},
        )
        for v in (r.view for r in replicas)
    ]
    return choices, held


FUSED6 = [member(f"f{i}", F) for i in range(6)]


def test_replicas_with_a_cutoff_choose_alike_whatever_order_their_events_came_in():
    for members in (FUSED6, PD3):
        for seed in range(8):
            (a, b), (held_a, held_b) = _replay(CUTOFF_S, seed, members)
            assert a == b, f"seed {seed}: {sum(x != y for x, y in zip(a, b, strict=True))} differ"
            assert held_a == held_b
            assert len(set(a)) > 1  # the loads moved the choice around


def test_without_a_cutoff_the_same_histories_split_the_replicas():
    """The control: the replays above, counted on arrival, do not agree (so the test above
    measures the cutoff, not an easy history)."""
    differ = sum(
        x != y for seed in range(8) for x, y in zip(*_replay(0.0, seed, FUSED6)[0], strict=True)
    )
    assert differ > 0


def test_under_a_cutoff_a_burst_spreads_over_the_workers_within_one_prefill_of_the_best():
    """Routes of the last cutoff count nowhere yet: rather than send a whole burst to the
    cheapest worker, each request goes, by its id, to one whose predicted time to first
    token is within this request's own prefill of the cheapest."""
    a = Replica(CUTOFF_S)
    view = a.view
    for m in FUSED6:
        view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=m))
    a.wall[0] = T0 + 1.0
    for m, queued in zip(FUSED6, (0, 50, 100, 150, 2000, 5000), strict=True):
        view.apply_load(fitted(m.id, token_ms=1.0, queued=queued, unix_ms=_ms(T0 + 0.9)))
    # 200 uncached tokens: 200 ms of prefill at the best, f0; f1..f3 wait 50-150 ms more.
    burst = [CacheAware().route(view, _request(i, T0 + 1.0 + i / 1000)) for i in range(40)]
    assert {p.decode.id for p in burst} == {"f0", "f1", "f2", "f3"}
    assert "tie of 4 broken by request id" in burst[0].reason
    unblind = ClusterView()
    for m in FUSED6:
        unblind.apply_membership(Ev(kind=Ev.KIND_JOINED, member=m))
    for m, queued in zip(FUSED6, (0, 50, 100, 150, 2000, 5000), strict=True):
        unblind.apply_load(fitted(m.id, token_ms=1.0, queued=queued))
    alone = CacheAware().route(unblind, _request(0, T0 + 1.0))
    assert alone.decode.id == "f0"  # counted at once, charges spread a burst by themselves


def test_a_request_stamped_far_ahead_of_the_masters_clock_does_not_stale_every_report():
    a = Replica(CUTOFF_S)
    view = a.view
    view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=member("w0", F)))
    a.wall[0] = T0 + 1.0
    view.apply_load(fitted("w0", unix_ms=_ms(T0 + 0.9)))
    plan = CacheAware().route(view, _request(0, T0 + 60.0))  # a frontend a minute ahead
    assert view.now() == T0 + 1.0 + 0.5 - CUTOFF_S
    assert view.load("w0") is not None and "no load report" not in plan.reason


def test_held_events_count_when_nothing_else_comes():
    """The view's feed moves the cut every cutoff: the last events of a burst count with no
    event or route after them."""
    a = Replica(CUTOFF_S)
    view = a.view
    view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=member("w0", F)))
    a.wall[0] = T0 + 1.0
    view.apply_kv_events(kv("w0", stored=H[:3], published_unix_ns=int((T0 + 0.99) * 1e9)))
    assert view.index.match("w0", H[:3]) == 0  # held: the cut is at the wall less 2 cutoffs
    a.wall[0] = T0 + 2.0  # nothing else arrives

    async def main() -> None:
        task = asyncio.create_task(view.count_held_forever())
        try:
            while view.index.match("w0", H[:3]) != 3:
                await asyncio.sleep(CUTOFF_S / 5)
        finally:
            task.cancel()

    asyncio.run(asyncio.wait_for(main(), 30))
    view.check_integrity()


def test_a_master_process_counts_a_lone_batch_under_a_cutoff(nats_server):
    """The master as deployed (`rtp-serve master --event-cutoff-ms`), on real NATS: one KV
    batch with nothing after it (no worker, report or route) reaches its index, by the cut's
    timer alone."""
    namespace, metrics_port = "lone-batch", free_port()
    flags = ("--nats-url", nats_server, "--namespace", namespace, "--event-cutoff-ms", "50",
             "--metrics-port", str(metrics_port))  # fmt: skip

    async def counted() -> bool:
        samples = await asyncio.to_thread(scrape, f"127.0.0.1:{metrics_port}")
        return total(samples, "rtp:index_blocks", worker="w-lone") == 3

    async def main() -> None:
        bus = await Bus.connect(nats_server, "test-publisher")
        try:
            batch = kv("w-lone", stored=H[:3], published_unix_ns=time.time_ns())
            await bus.publish(subjects.kv_events("w-lone", namespace), batch)
            await eventually(counted, 30, "the batch counted")
        finally:
            await bus.close()

    with grpc_service("master", *flags):  # serving once it has subscribed
        asyncio.run(main())
