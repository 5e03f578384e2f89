"""The vectorized policies (services/master/policy.py) choose exactly what the scalar
reference (services/master/policy_reference.py) chooses, on random cluster views: the same
plans (workers, matched blocks, predictions, reasons), the same charges, the same errors;
with and without an event cutoff (whose ties are wider)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtp_serve.core.cost_model import TIER_HOST, TIER_REMOTE, TIER_TRANSFER
from rtp_serve.services.common.pb import events_pb2, master_pb2
from rtp_serve.services.common.pb import nameservice_pb2 as ns
from rtp_serve.services.master import cost
from rtp_serve.services.master.cluster import ClusterView
from rtp_serve.services.master.load_table import LoadTable
from rtp_serve.services.master.policy import NoWorkersError, make_policy
from rtp_serve.services.master.policy_reference import make_reference

H = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(10)]
ROLES = {"p": ns.ROLE_PREFILL, "d": ns.ROLE_DECODE, "f": ns.ROLE_FUSED, "c": ns.ROLE_CACHE}
LORAS = ("a", "b")
# Few distinct values, so that predictions tie often and the tie rules are exercised.
FIXED = (0.0, 1e-3, 2e-3, 4e-3)
TOKEN = (0.0, 1e-4, 3e-4)
ROW = (0.0, 5e-4, 1e-3)
FETCH = ((0.0, 0.0), (1e-3, 0.0), (0.0, 1e-6), (2e-4, 1e-7))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@st.composite
def reports(draw, worker_id: str) -> events_pb2.LoadReport:
    r = events_pb2.LoadReport(
        worker_id=worker_id,
        num_waiting=draw(st.integers(0, 4)),
        max_num_waiting=draw(st.sampled_from((0, 2, 4))),
        num_running=draw(st.integers(0, 3)),
        max_num_seqs=draw(st.sampled_from((0, 2, 4))),
        free_blocks=draw(st.integers(0, 40)),
        total_blocks=40,
        queued_tokens=draw(st.sampled_from((0, 0, 16, 100, 333))),
        block_size=draw(st.sampled_from((0, 4, 16))),
        step_fixed_s=draw(st.sampled_from(FIXED)),
        step_token_s=draw(st.sampled_from(TOKEN)),
        step_row_s=draw(st.sampled_from(ROW)),
        step_token_budget=draw(st.sampled_from((0, 16, 64))),
        kv_block_bytes=draw(st.sampled_from((0, 1, 4096))),
        remote_tier=draw(st.booleans()),
        loras=draw(st.lists(st.sampled_from(LORAS), max_size=2, unique=True)),
    )
    r.resident_loras.extend(x for x in r.loras if draw(st.booleans()))
    for tier in (TIER_HOST, TIER_REMOTE, TIER_TRANSFER):
        if draw(st.booleans()):
            fixed, byte = draw(st.sampled_from(FETCH))
            r.fetch_costs.add(tier=tier, fixed_s=fixed, byte_s=byte)
    return r


@st.composite
def scripts(draw):
    """A cluster: members, their KV, their loads (some stale, some missing), charges; and
    the requests routed on it, in order."""
    counts = {
        "p": draw(st.integers(0, 4)),
        "d": draw(st.integers(0, 4)),
        "f": draw(st.integers(0, 4)),
        "c": draw(st.integers(0, 2)),
    }
    members = [
        ns.Member(
            id=f"{kind}{i}",
            role=ROLES[kind],
            address=f"host{draw(st.integers(0, 2))}:{50051 + i}",
        )
        for kind, n in counts.items()
        for i in range(n)
    ]
    ids = [m.id for m in members]
    kv = {}
    for w in ids:
        device = draw(st.integers(0, 8))
        host = draw(st.integers(0, 3))
        gap = draw(st.booleans())  # a hole: the host tier holds blocks after a missing one
        kv[w] = (H[:device], H[device + gap : device + gap + host])
    loads = {}
    for w in ids:
        if draw(st.integers(0, 4)):  # most report
            loads[w] = (draw(reports(w)), draw(st.sampled_from((0.0, 0.0, 0.5, 2.0))))
    charges = draw(
        st.lists(
            st.tuples(st.sampled_from(ids or ["x"]), st.integers(0, 200), st.integers(0, 9),
                      st.sampled_from((0.0, 0.1, 0.3, 2.5))),
            max_size=6,
        )
    )  # fmt: skip
    requests = []
    for i in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, 9))
        req = master_pb2.RouteRequest(
            request_id=draw(st.sampled_from(("r", "q", f"r{i}"))),
            block_hashes=H[:n],
            num_prompt_tokens=draw(st.integers(1, 12 * 16)),
            session_id=draw(st.sampled_from(("", "", "alice", "bob"))),
            lora_name=draw(st.sampled_from(("", "", "", *LORAS))),
        )
        req.exclude.extend(draw(st.lists(st.sampled_from(ids), max_size=3)) if ids else ())
        if draw(st.booleans()):  # as the frontend sends them
            req.packed_block_hashes = b"".join(req.block_hashes)
            del req.block_hashes[:]
        requests.append((req, draw(st.sampled_from((0.0, 0.01, 0.3)))))
    policy = draw(st.sampled_from(("cache_aware", "cache_aware", "least_load", "round_robin")))
    local = draw(st.sampled_from((0, 0, 40, 4000)))
    return members, kv, loads, charges, requests, policy, local


def build(members, kv, loads, charges, cutoff_s=0.0) -> tuple[ClusterView, Clock]:
    """The view after the script's events; with `cutoff_s`, each stamped when it came (and
    counted once a request stamped `cutoff_s` later is routed: `stamp`)."""
    clock = Clock()
    view = ClusterView(clock, event_cutoff_s=cutoff_s, wall=clock)
    Ev = ns.MembershipEvent
    for m in members:
        view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=m))
    for w, (device, host) in kv.items():
        view.apply_kv_events(events_pb2.KVEvents(worker_id=w, stored=device, host_stored=host))
    # Reports and charges as they came, oldest first (the view's clock is monotonic).
    timeline = [(age, 0, i) for i, (_, age) in enumerate(loads.values())]
    timeline += [(c[3], 1, i) for i, c in enumerate(charges)]
    reports = list(loads.values())
    for age, kind, i in sorted(timeline, key=lambda e: -e[0]):
        clock.now = 100.0 - age
        if kind == 0:
            report = events_pb2.LoadReport()
            report.CopyFrom(reports[i][0])
            report.unix_ms = _ms(clock.now)
            view.apply_load(report)
        else:
            w, tokens, blocks, _ = charges[i]
            view.charge(w, tokens, blocks, unix_ms=_ms(clock.now))
    clock.now = 100.0
    view.check_integrity()
    return view, clock


def _ms(t: float) -> int:
    return round(t * 1000)


def stamp(request: master_pb2.RouteRequest, clock: Clock, cutoff_s: float) -> None:
    """Under a cutoff, the request counts every event up to now (none: its own clock)."""
    if cutoff_s:
        request.unix_ms = _ms(clock.now + cutoff_s)


def outcome(policy, view: ClusterView, request: master_pb2.RouteRequest):
    try:
        decision = policy.decide(view, request)
    except NoWorkersError as e:
        return "no workers", str(e)
    view.check_integrity()
    return decision.plan.SerializeToString(deterministic=True), decision.reason


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts(), st.sampled_from((0.0, 0.0, 0.05)))
def test_vectorized_policies_choose_what_the_scalar_reference_chooses(script, cutoff_s):
    members, kv, loads, charges, requests, name, local = script
    (fast_view, fast_clock), (ref_view, ref_clock) = (
        build(members, kv, loads, charges, cutoff_s),
        build(members, kv, loads, charges, cutoff_s),
    )
    fast, ref = make_policy(name, local), make_reference(name, local)
    for request, dt in requests:
        fast_clock.now += dt
        ref_clock.now += dt
        stamp(request, fast_clock, cutoff_s)
        assert outcome(fast, fast_view, request) == outcome(ref, ref_view, request)
        for m in members:
            assert fast_view.pending(m.id) == ref_view.pending(m.id)


def test_the_vector_formulas_are_the_scalar_ones_to_the_bit():
    """One candidate per combination of the cases in cost.predict and cost.decode_cost."""
    rng = np.random.default_rng(0)
    table, reports = LoadTable(), []
    for i in range(400):
        r = events_pb2.LoadReport(
            worker_id=f"w{i:03d}",
            num_running=int(rng.integers(0, 5)),
            queued_tokens=int(rng.integers(0, 5000)),
            block_size=int(rng.choice([0, 16, 32])),
            step_fixed_s=float(rng.choice([0.0, rng.uniform(1e-4, 1e-2)])),
            step_token_s=float(rng.choice([0.0, rng.uniform(1e-6, 1e-3)])),
            step_row_s=float(rng.uniform(0, 1e-3)),
            step_token_budget=int(rng.choice([0, 256, 2048])),
            kv_block_bytes=int(rng.choice([0, 98304])),
            remote_tier=bool(rng.integers(0, 2)),
        )
        for tier in (TIER_HOST, TIER_REMOTE, TIER_TRANSFER):
            if rng.integers(0, 3):
                r.fetch_costs.add(tier=tier, fixed_s=float(rng.uniform(0, 1e-3)),
                                  byte_s=float(rng.uniform(0, 1e-9)))  # fmt: skip
        table.add(ns.Member(id=r.worker_id, role=ns.ROLE_FUSED, address=f"h:{i}"))
        table.set_load(r.worker_id, r, 0.0)
        reports.append(r)
    slots = table.order(ns.ROLE_FUSED)
    loads = table.gather(slots, 0.0, 1.0)
    steps = cost.Steps.of(loads)
    local = rng.integers(0, 40, len(reports))
    host = rng.integers(0, 10, len(reports))
    for tokens, reachable in ((1, 0), (700, 0), (700, 30), (5000, 80)):
        seconds = cost.predict_seconds(loads, steps, tokens, local, host, reachable)
        rows = loads.running + 1
        decode, _ = cost.decode_seconds(loads, steps, rows, tokens, local)
        for i, r in enumerate(reports):
            step = steps.step(i)
            bs = r.block_size or 16
            expect = cost.predict(r, step, 0, tokens, bs, int(local[i]), int(host[i]), reachable)
            assert seconds[i] == expect.seconds, (i, r)
            d = cost.decode_cost(r, step, int(rows[i]), tokens, bs, int(local[i]))
            assert decode[i] == d.seconds, (i, r)


@pytest.mark.parametrize("n", [3, 200])
def test_the_table_follows_the_view(n):
    """Loads, membership changes and charges: the table's pending sums and slots stay the
    view's (check_integrity compares them), across joins, leaves and expiries."""
    clock = Clock()
    view = ClusterView(clock)
    Ev = ns.MembershipEvent
    ms = [ns.Member(id=f"w{i}", role=ns.ROLE_FUSED, address=f"h:{i}") for i in range(n)]
    for m in ms:
        view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=m))
    for step in range(50):
        clock.now += 0.1
        m = ms[step * 7 % n]
        view.charge(m.id, tokens=step, blocks=1)
        if step % 5 == 0:
            view.apply_load(events_pb2.LoadReport(worker_id=m.id, num_running=step))
        if step % 11 == 0:
            view.apply_membership(Ev(kind=Ev.KIND_LEFT, member=m))
            view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=m))
        view.expire_charges()
        view.check_integrity()
    assert [view.table.member(s).id for s in view.table.order(ns.ROLE_FUSED)] == sorted(
        m.id for m in ms
    )
