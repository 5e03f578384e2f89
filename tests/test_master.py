"""The master: prefix index, cluster view, policies (exact, scripted); the service on NATS."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import subprocess
import sys
import threading
import time

import grpc
import pytest

from rtp_serve.services.common import grpc_util, rendezvous, subjects
from rtp_serve.services.common.pb import events_pb2, master_pb2, master_pb2_grpc
from rtp_serve.services.common.pb import nameservice_pb2 as ns
from rtp_serve.services.master.cluster import IN_TRANSIT_S, ClusterView, Pending
from rtp_serve.services.master.policy import (
    CacheAware,
    LeastLoad,
    NoWorkersError,
    RoundRobin,
    make_policy,
)
from rtp_serve.services.master.prefix_index import PrefixIndex

H = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(16)]
Ev = ns.MembershipEvent
P, D, F = ns.ROLE_PREFILL, ns.ROLE_DECODE, ns.ROLE_FUSED


def member(worker_id: str, role: int) -> ns.Member:
    return ns.Member(id=worker_id, role=role, address=f"{worker_id}.local:50051")


def kv(worker_id: str, seq: int = 0, stored=(), **fields) -> events_pb2.KVEvents:
    return events_pb2.KVEvents(worker_id=worker_id, seq=seq, stored=stored, **fields)


def load(
    worker_id: str, queued=0, running=0, free=100, block_size=16, **fields
) -> events_pb2.LoadReport:
    fields |= dict(queued_tokens=queued, num_running=running, free_blocks=free, total_blocks=100)
    return events_pb2.LoadReport(worker_id=worker_id, block_size=block_size, **fields)


def cluster(*members: ns.Member, cached=None, loads=(), clock=time.monotonic) -> ClusterView:
    view = ClusterView(clock)
    for m in members:
        view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=m))
    for worker_id, hashes in (cached or {}).items():
        assert view.apply_kv_events(kv(worker_id, stored=hashes))
    for report in loads:
        assert view.apply_load(report)
    view.check_integrity()
    return view


def route(policy, view, tokens=100, hashes=H[:6], session="", exclude=()) -> master_pb2.RoutePlan:
    req = master_pb2.RouteRequest(
        request_id="r", block_hashes=hashes, num_prompt_tokens=tokens, session_id=session
    )
    req.exclude.extend(exclude)
    plan = policy.route(view, req)
    view.check_integrity()
    return plan


# -- prefix index ------------------------------------------------------------------------
def test_prefix_index_scripted():
    idx = PrefixIndex()
    idx.apply(kv("a", 1, stored=H[:4]))
    idx.apply(kv("b", 1, stored=[H[0], H[1], H[3]]))
    idx.check_integrity()
    assert idx.match("a", H[:6]) == 4
    assert idx.match("b", H[:6]) == 2  # stops at the first miss (H[2])
    assert idx.match_all(H[:6], ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    assert idx.match_all(H[:2], ["a", "b"]) == {"a": 2, "b": 2}
    assert idx.match_all([], ["a"]) == {"a": 0}
    idx.apply(kv("a", 2, removed=[H[1]]))
    assert idx.match_all(H[:6], ["a", "b"]) == {"a": 1, "b": 2}
    idx.apply(kv("a", 3, stored=[H[1]]))  # order is index_sync's business: applied
    assert idx.match("a", H) == 4 and idx.sizes() == {"a": 4, "b": 3}
    idx.apply(kv("a", 1, stored=[H[9]], cleared=True))  # cleared first, then stored
    assert idx.match("a", H) == 0 and idx.holds("a", H[9]) and len(idx) == 4
    idx.replace("b", [H[5], H[6]])  # a resync: exactly these
    assert idx.hashes("b") == {H[5], H[6]} and not idx.holds("b", H[0])
    idx.check_integrity()
    idx.drop_worker("b")
    assert idx.workers() == ["a"] and idx.match("b", H) == 0
    idx.remove("a", [H[9], H[10]])
    assert len(idx) == 0 and idx.workers() == []
    idx.store("a", [b"short"])  # malformed hashes never enter
    assert len(idx) == 0 and idx.check_integrity() is None
    with pytest.raises(ValueError):
        idx.apply(kv(""))


# -- cluster view ------------------------------------------------------------------------
def test_left_member_is_forgotten_and_late_events_ignored():
    view = cluster(member("p1", P), member("p2", P), cached={"p2": H[:3]}, loads=[load("p2")])
    view.apply_membership(Ev(kind=Ev.KIND_LEFT, member=member("p2", P), reason="expired"))
    view.check_integrity()
    assert [m.id for m in view.members(P)] == ["p1"]
    assert view.index.workers() == [] and view.load("p2") is None
    assert not view.apply_kv_events(kv("p2", stored=H[:3]))  # late NATS traffic
    assert not view.apply_load(load("p2"))
    view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=member("p2", P)))  # back again
    assert view.apply_kv_events(kv("p2", stored=H[:1]))
    assert view.index.match("p2", H) == 1
    view.check_integrity()


def test_snapshot_after_reconnect_drops_unconfirmed_members():
    view = cluster(member("p1", P), member("p2", P), cached={"p1": H[:2], "p2": H[:2]})
    view.apply_membership(Ev(kind=Ev.KIND_SNAPSHOT, member=member("p1", P)))
    view.apply_membership(Ev(kind=Ev.KIND_SNAPSHOT, member=member("d1", D)))
    assert view.in_snapshot and [m.id for m in view.members()] == ["d1", "p1", "p2"]
    view.check_integrity()
    view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=member("p3", P)))  # snapshot over
    assert not view.in_snapshot
    assert [m.id for m in view.members()] == ["d1", "p1", "p3"]
    assert view.index.workers() == ["p1"]  # the confirmed member keeps its prefix entries
    view.check_integrity()


# -- policies ----------------------------------------------------------------------------
PD3 = (member("p1", P), member("p2", P), member("p3", P), member("d1", D), member("d2", D))
CACHED = {"p1": H[:2], "p2": H[:5]}


def test_longest_prefix_wins():
    plan = route(CacheAware(), cluster(*PD3, cached=CACHED))
    assert (plan.prefill.id, plan.matched_blocks, plan.policy) == ("p2", 5, "cache_aware")
    assert plan.reason.startswith("prefix 5 blocks on p2, cost 20 tokens")  # 100 - 5 * 16


def test_packed_hashes_route_as_the_repeated_field_does():
    """RouteRequest.packed_block_hashes (what the frontend sends) is the same prompt."""
    from rtp_serve.services.master.packed_hashes import PackedHashes

    packed = PackedHashes(b"".join(H))
    assert list(packed) == H and packed[3] == H[3] and packed[-1] == H[-1]
    assert list(packed[2:7]) == H[2:7] and isinstance(packed[2:7], PackedHashes)
    assert len(packed[14:99]) == 2 and len(packed[9:3]) == 0
    with pytest.raises(ValueError, match="not a multiple of 16"):
        PackedHashes(H[0][:5])
    loads = [load(m.id, queued=20 * i) for i, m in enumerate(PD3)]
    for hashes in (H[:0], H[:1], H[:3], H[:6], H[2:8], H):
        plans = []
        for packed_too in (False, True):
            view = cluster(*PD3, cached=CACHED, loads=loads)
            req = master_pb2.RouteRequest(request_id="r", num_prompt_tokens=300)
            if packed_too:
                req.packed_block_hashes = b"".join(hashes)
            else:
                req.block_hashes.extend(hashes)
            plans.append([CacheAware(max_local_prefill_tokens=64).route(view, req)
                          for _ in range(3)])  # fmt: skip
        assert plans[0] == plans[1]


def test_clearly_more_loaded_worker_loses_its_prefix():
    idle = [load("p1"), load("p3")]
    busy = cluster(*PD3, cached=CACHED, loads=[*idle, load("p2", queued=500)])
    plan = route(CacheAware(), busy)
    assert (plan.prefill.id, plan.matched_blocks) == ("p1", 2)  # 68 < 520 < 100
    slightly = cluster(*PD3, cached=CACHED, loads=[*idle, load("p2", queued=40)])
    assert route(CacheAware(), slightly).prefill.id == "p2"  # 60 < 68
    big_blocks = cluster(*PD3, cached=CACHED, loads=[*idle, load("p1", block_size=64)])
    assert route(CacheAware(), big_blocks).prefill.id == "p1"  # 2 * 64 covers the prompt


def _winner(key: str, members) -> str:
    return rendezvous.order(key, [m.id for m in members])[0]


def test_ties_session_affinity_then_fewest_running():
    for session in ("alice", "bob", "carol"):  # an idle cluster: a three-way tie
        expected = _winner(session, PD3[:3])
        picks = {route(CacheAware(), cluster(*PD3), session=session).prefill.id for _ in range(3)}
        assert picks == {expected}
    spread = {route(CacheAware(), cluster(*PD3), session=f"s{i}").prefill.id for i in range(20)}
    assert spread == {"p1", "p2", "p3"}
    assert "tie of 3 broken by session" in route(CacheAware(), cluster(*PD3), session="x").reason
    loaded = cluster(*PD3, loads=[load("p1", running=3), load("p2", running=1), load("p3")])
    plan = route(CacheAware(), loaded)
    assert plan.prefill.id == "p3" and "(tie of 3 broken by fewest running)" in plan.reason
    even = [load(w, running=1) for w in ("p1", "p2", "p3")]
    plan = route(CacheAware(), cluster(*PD3, loads=even))
    expected = _winner("r", PD3[:3])  # the request id's rendezvous: the same on any replica
    assert plan.prefill.id == expected and "(tie of 3 broken by request id)" in plan.reason
    policy = CacheAware()  # no rotation state: the same view gives the same choice each time
    assert {route(policy, cluster(*PD3, loads=even)).prefill.id for _ in range(5)} == {expected}


def test_burst_is_charged_until_the_next_load_report():
    now = [0.0]
    view, policy = cluster(*PD3, cached=CACHED, clock=lambda: now[0]), CacheAware()
    plans = [route(policy, view) for _ in range(6)]
    # costs start p1 68, p2 20, p3 100; each pick adds its uncached tokens to that worker
    assert [p.prefill.id for p in plans] == ["p2", "p2", "p2", "p1", "p2", "p3"]
    # decode: a tie at first (broken by the request id's hash), then the one charged less
    assert [p.decode.id for p in plans] == ["d2", "d1", "d2", "d1", "d2", "d1"]
    assert view.pending("p2").tokens == 80 and view.pending("d1").blocks == 21
    # A report made as they were routed may not count them yet: they are still on their way
    view.apply_load(load("p2"))
    assert view.pending("p2").tokens == 80
    now[0] = IN_TRANSIT_S + 0.01
    view.charge("p2", tokens=7)  # one more, routed just before the next report: it is kept
    view.apply_load(load("p2"))  # the report includes what was routed well before it
    assert view.pending("p2") == Pending(requests=1, tokens=7, blocks=0)
    now[0] = 2 * IN_TRANSIT_S + 0.02
    view.apply_load(load("p2"))
    assert view.pending("p2").requests == 0
    assert route(policy, view).prefill.id == "p2"
    now[0] = 60.0  # no report ever came: charges expire
    assert view.pending("p1").requests == 0 and route(policy, view).prefill.id == "p2"
    for i in range(1000):  # a charge every second, never asked for, no report: none piles up
        now[0] = 100.0 + i
        view.charge("p3", 5)
    assert len(view._pending["p3"]) <= 3


def test_decode_fewest_running_then_most_free_blocks():
    """No decode worker fitted yet: the cost is in decode rows."""
    loads = [load("d1", free=10), load("d2", free=50)]
    assert route(CacheAware(), cluster(*PD3, loads=loads)).decode.id == "d2"
    loads = [load("d1", free=50, running=2), load("d2", free=60, running=1)]
    plan = route(CacheAware(), cluster(*PD3, loads=loads))
    assert plan.decode.id == "d2"
    assert plan.reason.endswith("; decode d2 (free 60 blocks, a slot free, cost 2 rows)")
    assert route(CacheAware(), cluster(*PD3, loads=[load("d2", free=0)])).decode.id == "d2"


def _transfer(ms_per_block: float) -> dict:
    cost = events_pb2.TierFetchCost(tier="transfer", fixed_s=0.0, byte_s=ms_per_block / 1e3)
    return dict(fetch_costs=[cost], kv_block_bytes=1)


def test_decode_prefers_the_worker_that_holds_the_prefix_once_transfers_are_timed():
    """100 tokens are 7 blocks; d1 holds the first 6, so only 1 moves there (1 ms) against
    7 to d2 (7 ms). Untimed, the transfer costs nothing and the freer d2 wins."""
    cached = {"d1": H[:6]}
    timed = [fitted("d1", free=20, **_transfer(1.0)), fitted("d2", free=90, **_transfer(1.0))]
    plan = route(CacheAware(), cluster(*PD3, cached=cached, loads=timed))
    assert plan.decode.id == "d1"
    assert plan.reason.endswith(
        "decode d1 (free 20 blocks, a slot free, cost 1.0 ms (transfer 1.0 of 1 blocks + step 0.0))"
    )
    untimed = [fitted("d1", free=20), fitted("d2", free=90)]
    assert route(CacheAware(), cluster(*PD3, cached=cached, loads=untimed)).decode.id == "d2"
    # least_load ignores every cache, the decode side's too.
    assert route(LeastLoad(), cluster(*PD3, cached=cached, loads=timed)).decode.id == "d2"


def test_a_busy_decode_worker_loses_its_prefix_advantage():
    """d1 saves 6 ms of transfer but its batch of 20 rows costs 20 ms a step more."""
    cached = {"d1": H[:6]}
    loads = [
        fitted("d1", row_ms=1.0, running=20, **_transfer(1.0)),
        fitted("d2", row_ms=1.0, **_transfer(1.0)),
    ]
    assert route(CacheAware(), cluster(*PD3, cached=cached, loads=loads)).decode.id == "d2"


def test_a_decode_worker_with_a_full_batch_loses_to_one_with_a_free_slot():
    """d1 holds the prefix and steps faster, but its batch of 2 is full: the request would
    wait there for a stream to end, which no step cost prices. The streams routed to a
    worker since its report, and those waiting there, count toward its batch; among full
    ones, the fewest waiting for a slot wins."""
    cached = {"d1": H[:6]}
    full = dict(max_num_seqs=2, **_transfer(1.0))
    loads = [fitted("d1", running=2, **full), fitted("d2", row_ms=5.0, running=1, **full)]
    plan = route(CacheAware(), cluster(*PD3, cached=cached, loads=loads))
    assert plan.decode.id == "d2" and ", a slot free, " in plan.reason
    # Unbounded (no max_num_seqs said), d1 is the cheaper.
    loads = [fitted("d1", running=2, **_transfer(1.0)), fitted("d2", row_ms=5.0, running=1)]
    assert route(CacheAware(), cluster(*PD3, cached=cached, loads=loads)).decode.id == "d1"
    # d2's one free slot is taken by a request routed since its report (or one waiting).
    view = cluster(*PD3, cached=cached,
                   loads=[fitted("d1", running=1, num_waiting=2, **full),
                          fitted("d2", running=1, **full)])  # fmt: skip
    view.charge("d2", blocks=7)
    plans = [route(CacheAware(), view) for _ in range(3)]
    # d1: 1 running + 2 waiting; d2: 1 + 1 routed. The first goes to d2 (1 to wait there
    # against 2), then to the one with fewer to wait (on a tie, d1: its transfer is 1 block).
    assert [p.decode.id for p in plans] == ["d2", "d1", "d2"]
    assert ", batch full, 1 to wait for a slot, cost " in plans[0].reason


def test_a_decode_worker_without_room_for_the_blocks_it_lacks_loses():
    """d1 is cheaper (it holds the prefix) but has 0 free blocks for the 1 it lacks."""
    cached = {"d1": H[:6]}
    loads = [fitted("d1", free=0, **_transfer(1.0)), fitted("d2", free=90, **_transfer(1.0))]
    assert route(CacheAware(), cluster(*PD3, cached=cached, loads=loads)).decode.id == "d2"


def test_conditional_disaggregation_keeps_short_prompts_on_the_decode_worker():
    loads = [load("d1", free=10), load("d2", free=50)]
    # 100 uncached tokens < 128: the decode worker computes the prompt itself.
    plan = route(CacheAware(max_local_prefill_tokens=128), cluster(*PD3, loads=loads))
    assert not plan.HasField("prefill") and plan.decode.id == "d2"
    assert plan.reason.startswith("local prefill on d2: 100 uncached tokens < 128")
    # Its own cached prefix counts: 6 blocks of 16 cached there leave 4 of 100 tokens.
    roomy_d1 = [load("d1", free=60), load("d2", free=50)]
    view = cluster(*PD3, loads=roomy_d1, cached={"d1": H[:6]})
    plan = route(CacheAware(max_local_prefill_tokens=8), view)
    assert not plan.HasField("prefill") and (plan.decode.id, plan.matched_blocks) == ("d1", 6)
    assert "4 uncached tokens < 8" in plan.reason
    longer = route(CacheAware(max_local_prefill_tokens=64), cluster(*PD3, loads=loads))
    assert longer.HasField("prefill") and longer.decode.id == "d2"  # 100 >= 64: PD
    assert route(CacheAware(), cluster(*PD3, loads=loads)).HasField("prefill")  # 0: always PD
    assert make_policy("round_robin", 128).max_local_prefill_tokens == 128


def fitted(worker_id: str, token_ms=1.0, fixed_ms=0.0, row_ms=0.0, budget=0, **fields):
    """A load report with a fitted step model: fixed + token * p + row * r milliseconds."""
    return load(worker_id, step_fixed_s=fixed_ms / 1e3, step_token_s=token_ms / 1e3,
                step_row_s=row_ms / 1e3, step_token_budget=budget, **fields)  # fmt: skip


def test_a_busy_decode_worker_hands_short_prompts_to_an_idle_prefill_worker():
    """100 tokens at 1 ms each; sending them costs 7 blocks at 1 ms. A decode worker with
    500 tokens queued would answer in 600 ms, an idle prefill worker (another host) in
    100 + 7: PD. Idle, the decode worker answers in 100 ms against 107: it computes the
    prompt itself."""
    idle_p = [fitted(p) for p in ("p1", "p2", "p3")]
    busy = [fitted("d1", queued=500, free=90, **_transfer(1.0)),
            fitted("d2", queued=500, free=50, **_transfer(1.0))]  # fmt: skip
    plan = route(CacheAware(max_local_prefill_tokens=128), cluster(*PD3, loads=idle_p + busy))
    assert plan.HasField("prefill") and plan.decode.id == "d1"
    idle = [fitted("d1", free=90, **_transfer(1.0)), fitted("d2", free=50, **_transfer(1.0))]
    plan = route(CacheAware(max_local_prefill_tokens=128), cluster(*PD3, loads=idle_p + idle))
    assert not plan.HasField("prefill") and plan.decode.id == "d1"
    assert plan.reason.endswith("predicted 100.0 ms here against 107.0 ms on p1 with the transfer")
    assert plan.predicted_ttft_s == pytest.approx(0.1)
    # Prefill workers that have computed nothing yet borrow the decode workers' model.
    unfitted_p = [load(p) for p in ("p1", "p2", "p3")]
    plan = route(CacheAware(max_local_prefill_tokens=128), cluster(*PD3, loads=unfitted_p + busy))
    assert plan.HasField("prefill")
    # Prefill workers without a load report, or a decode worker without a fitted model:
    # the size rule alone.
    plan = route(CacheAware(max_local_prefill_tokens=128), cluster(*PD3, loads=busy))
    assert not plan.HasField("prefill")
    unfitted_d = [load("d1", queued=500, free=90), load("d2", queued=500, free=50)]
    plan = route(CacheAware(max_local_prefill_tokens=128), cluster(*PD3, loads=idle_p + unfitted_d))
    assert not plan.HasField("prefill")
    # Prefill workers on the decode workers' host share its cores: moving there adds none.
    one_host = [ns.Member(id=m.id, role=m.role, address=f"10.0.0.1:{5000 + i}")
                for i, m in enumerate(PD3)]  # fmt: skip
    plan = route(CacheAware(max_local_prefill_tokens=128), cluster(*one_host, loads=idle_p + busy))
    assert not plan.HasField("prefill") and plan.predicted_ttft_s == pytest.approx(0.6)
    # round_robin predicts nothing: the size rule alone.
    plan = route(RoundRobin(max_local_prefill_tokens=128), cluster(*PD3, loads=idle_p + busy))
    assert not plan.HasField("prefill")


def test_the_worker_that_answers_first_in_seconds_wins():
    # p2 holds 5 blocks (20 tokens left) but is slow (10 ms a token) and has 100 tokens
    # queued: 1.2 s. p1 holds 2 blocks (68 tokens) at 1 ms a token: 0.068 s.
    loads = [fitted("p1"), fitted("p2", token_ms=10.0, queued=100), fitted("p3", token_ms=100)]
    plan = route(CacheAware(), cluster(*PD3, cached=CACHED, loads=loads))
    assert (plan.prefill.id, plan.matched_blocks) == ("p1", 2)
    assert plan.reason.startswith("prefix 2 blocks on p1, cost 68.0 ms (wait 0.0 + prefill")
    assert plan.predicted_ttft_s == pytest.approx(0.068)
    # Without the queue p2 is first: 20 * 10 ms = 0.2 s, against 100 * 4 ms on p1 now.
    loads = [fitted("p1", token_ms=4.0), fitted("p2", token_ms=10.0)]
    plan = route(CacheAware(), cluster(*PD3, cached=CACHED, loads=loads))
    assert plan.prefill.id == "p2" and plan.predicted_ttft_s == pytest.approx(0.2)


def test_prediction_counts_chunks_and_the_running_batch():
    # p1: 2 ms a step + 1 ms a token + 0.5 ms a running row, 64 tokens a step, 4 running.
    # 100 queued + 68 own = 168 tokens: 3 chunks of (2 + 2) ms, 168 ms of tokens, plus the
    # step in flight (4 ms) = 184 ms.
    loads = [fitted("p1", fixed_ms=2.0, row_ms=0.5, budget=64, queued=100, running=4)]
    view = cluster(member("p1", P), member("d1", D), cached={"p1": H[:2]}, loads=loads)
    plan = route(CacheAware(), view)
    assert plan.predicted_ttft_s == pytest.approx(0.184)
    assert (
        "wait 112.0 + prefill 72.0 of 68 tokens" in plan.reason
    )  # 4 + 2 * 4 + 100 | 168 - 100 - 12 + 12
    # The plan carries the terms, for the frontend to set beside what happened.
    assert (plan.predicted_wait_s, plan.predicted_prefill_s, plan.predicted_fetch_s) == (
        pytest.approx(0.112), pytest.approx(0.072), 0.0)  # fmt: skip
    # round_robin predicts nothing, term by term too.
    plan = route(RoundRobin(), view)
    assert (plan.predicted_ttft_s, plan.predicted_wait_s, plan.predicted_prefill_s) == (0, 0, 0)


def test_blocks_only_the_cache_instances_hold_are_fetched_not_computed():
    """The remote tier is the union of the cache instances' memory (keys are sharded
    between them): c1 and c2 hold the prompt's 6 blocks between them, no worker does."""
    fetch = [events_pb2.TierFetchCost(tier="remote", fixed_s=1e-3, byte_s=1e-3 / 2**20)]
    tiers = dict(remote_tier=True, fetch_costs=fetch, kv_block_bytes=2**20)
    caches = (member("c1", ns.ROLE_CACHE), member("c2", ns.ROLE_CACHE))
    held = {"c1": H[0:6:2], "c2": H[1:6:2]}
    loads = [fitted("p1", **tiers), fitted("p2", **tiers), fitted("p3", **tiers)]
    plan = route(CacheAware(), cluster(*PD3, *caches, cached=held, loads=loads))
    assert plan.prefill.id in ("p1", "p2", "p3")  # never a cache instance
    assert "fetch 7.0 of 6 blocks" in plan.reason
    assert plan.remote_blocks == 6  # what the worker's lookup may ask the remote tier for
    # With c2 gone, only block 0 is reachable: 1 block fetched, the rest computed.
    plan = route(CacheAware(), cluster(*PD3, caches[0], cached={"c1": H[0:6:2]}, loads=loads))
    assert "fetch 2.0 of 1 blocks" in plan.reason
    assert plan.remote_blocks == 1
    # Nothing held anywhere: the plan says so, and the worker asks the remote tier nothing.
    plan = route(CacheAware(), cluster(*PD3, *caches, loads=loads))
    assert plan.HasField("remote_blocks") and plan.remote_blocks == 0
    # A policy that ignores prefixes looks nothing up, and says nothing.
    assert not route(RoundRobin(), cluster(*PD3, *caches, cached=held, loads=loads)).HasField(
        "remote_blocks"
    )


def test_cached_but_busy_loses_to_idle_but_cold_that_fetches():
    # All on one machine's rates: 1 ms a token; remote fetches 1 ms + 1 ms per MiB.
    fetch = [events_pb2.TierFetchCost(tier="remote", fixed_s=1e-3, byte_s=1e-3 / 2**20)]
    tiers = dict(remote_tier=True, fetch_costs=fetch, kv_block_bytes=2**20)
    # p2 holds all 6 blocks of a 100-token prompt (4 tokens to compute) but 300 are queued.
    busy = [fitted("p2", queued=300, **tiers), fitted("p1", **tiers), fitted("p3", **tiers)]
    plan = route(CacheAware(), cluster(*PD3, cached={"p2": H[:6]}, loads=busy))
    # p1 fetches the 6 blocks (7 ms) and computes 4 tokens (4 ms): 11 ms < p2's 304 ms.
    assert plan.prefill.id in ("p1", "p3") and plan.matched_blocks == 0
    assert plan.predicted_ttft_s == pytest.approx(0.011)
    assert "fetch 7.0 of 6 blocks" in plan.reason
    # Idle, the holder wins: 4 ms, nothing to fetch.
    idle = [fitted("p2", **tiers), fitted("p1", **tiers), fitted("p3", **tiers)]
    plan = route(CacheAware(), cluster(*PD3, cached={"p2": H[:6]}, loads=idle))
    assert (plan.prefill.id, plan.matched_blocks) == ("p2", 6)
    assert plan.predicted_ttft_s == pytest.approx(0.004)
    # Without a remote tier the cold worker must compute all 100 tokens: p2's queue of 300
    # is still worse (304 ms > 100 ms), but one of 90 is not (94 ms < 100 ms).
    alone = [fitted("p2", queued=300), fitted("p1"), fitted("p3")]
    assert route(CacheAware(), cluster(*PD3, cached={"p2": H[:6]}, loads=alone)).prefill.id != "p2"
    alone = [fitted("p2", queued=90), fitted("p1"), fitted("p3")]
    assert route(CacheAware(), cluster(*PD3, cached={"p2": H[:6]}, loads=alone)).prefill.id == "p2"
    # A fetch nobody has timed yet earns no credit: the cold workers count 100 tokens.
    untimed = [fitted("p2", queued=90, remote_tier=True), fitted("p1", remote_tier=True)]
    view = cluster(*PD3, cached={"p2": H[:6]}, loads=untimed)
    assert route(CacheAware(), view).prefill.id == "p2"


def test_host_tier_blocks_cost_their_copy_up():
    # p1's pool holds 2 blocks of the prompt and its host tier the next 4 (copy-up 0.5 ms a
    # block): 6 blocks for 2 ms + 4 tokens; p2's pool holds 5 blocks: 20 tokens, 20 ms.
    host = [events_pb2.TierFetchCost(tier="host", fixed_s=0.0, byte_s=0.5e-3)]
    loads = [fitted("p1", fetch_costs=host, kv_block_bytes=1), fitted("p2"), fitted("p3")]
    view = cluster(*PD3, cached=CACHED, loads=loads)
    batch = kv("p1", stored=[])
    batch.host_stored.extend(H[2:6])
    assert view.apply_kv_events(batch) and view.index.host.hashes("p1") == set(H[2:6])
    plan = route(CacheAware(), view)
    assert (plan.prefill.id, plan.matched_blocks) == ("p1", 2)
    assert plan.predicted_ttft_s == pytest.approx(0.006)
    assert "fetch 2.0 of 4 blocks" in plan.reason
    # Untimed, the copy-up earns nothing: p2's 20 tokens beat p1's 68.
    loads = [fitted("p1"), fitted("p2"), fitted("p3")]
    view = cluster(*PD3, cached=CACHED, loads=loads)
    assert view.apply_kv_events(batch)
    assert route(CacheAware(), view).prefill.id == "p2"


def test_hot_prefix_spreads_once_its_holder_is_the_slower_answer():
    # A burst of one hot prompt: each pick is charged to its worker, so the holder wins
    # until its queue outweighs the others' fetch + 4 tokens, then the burst spreads.
    fetch = [events_pb2.TierFetchCost(tier="remote", fixed_s=1e-3, byte_s=0.0)]
    tiers = dict(remote_tier=True, fetch_costs=fetch, kv_block_bytes=1)
    loads = [fitted(w, **tiers) for w in ("p1", "p2", "p3")]
    view, policy = cluster(*PD3, cached={"p2": H[:6]}, loads=loads), CacheAware()
    picks = [route(policy, view).prefill.id for _ in range(9)]
    # p2: 4, 8 (after one charge of 4), ... ms; p1/p3: fetch 1 + 4 = 5 ms, then 9, ...
    assert picks[0] == "p2" and len(set(picks)) == 3
    assert picks.count("p2") <= 4


def test_least_load_ignores_every_cache():
    loads = [fitted("p1", queued=10), fitted("p2", queued=50), fitted("p3", queued=20)]
    plan = route(LeastLoad(), cluster(*PD3, cached=CACHED, loads=loads))
    assert (plan.prefill.id, plan.policy) == ("p1", "least_load")
    assert plan.predicted_ttft_s == pytest.approx(0.110)  # 10 queued + all 100 tokens
    assert make_policy("least_load").name == "least_load"


def test_unfitted_worker_borrows_the_mean_coefficients():
    # p3 has no fitted model yet: its 100 queued + 100 prompt tokens count at the mean of
    # p1's and p2's 1 ms a token (0.2 s), against their 300 and 500 tokens queued.
    loads = [fitted("p1", queued=300), fitted("p2", queued=500), load("p3", queued=100)]
    plan = route(CacheAware(), cluster(*PD3, loads=loads), hashes=[])
    assert plan.prefill.id == "p3" and plan.predicted_ttft_s == pytest.approx(0.2)
    # Nobody fitted: costs in tokens, and no prediction in seconds on the plan.
    plan = route(CacheAware(), cluster(*PD3, loads=[load("p1", queued=5)]))
    assert plan.predicted_ttft_s == 0.0 and "tokens" in plan.reason


def test_full_queue_is_skipped_while_another_has_room():
    full = dict(num_waiting=4, max_num_waiting=4)
    # p2 holds the longest prefix, but its queue is at its bound.
    plan = route(CacheAware(), cluster(*PD3, cached=CACHED, loads=[load("p2", **full)]))
    assert plan.prefill.id == "p1"
    # The decode side too: d2 has more free blocks but a full queue.
    loads = [load("d1", free=10), load("d2", free=50, **full)]
    assert route(CacheAware(), cluster(*PD3, loads=loads)).decode.id == "d1"
    # When every candidate is full the cheapest is still chosen (it refuses: 429).
    loads = [load(w, **full) for w in ("p1", "p2", "p3")]
    assert route(CacheAware(), cluster(*PD3, cached=CACHED, loads=loads)).prefill.id == "p2"
    # A queue below its bound (or no bound reported) is routable.
    loads = [load("p2", num_waiting=3, max_num_waiting=4), load("p1", num_waiting=9)]
    assert route(CacheAware(), cluster(*PD3, cached=CACHED, loads=loads)).prefill.id == "p2"


def test_round_robin_cycles_each_side():
    policy, view = RoundRobin(), cluster(*PD3, cached=CACHED)
    plans = [route(policy, view) for _ in range(4)]
    assert [p.prefill.id for p in plans] == ["p1", "p2", "p3", "p1"]
    assert [p.decode.id for p in plans] == ["d1", "d2", "d1", "d2"]
    assert [p.matched_blocks for p in plans] == [2, 5, 0, 2]
    assert {p.policy for p in plans} == {"round_robin"}


def test_modes_exclude_and_no_workers():
    fused = (member("f1", F), member("f2", F))
    view = cluster(*PD3, *fused, cached={"f2": H[:3], "p2": H[:1]})
    plan = route(CacheAware(), view)
    assert (plan.prefill.id, plan.decode.id) == ("p2", "d2")  # PD preferred
    plan = route(CacheAware(), view, exclude=["p1", "p2", "p3"])  # no prefill left: fused
    assert not plan.HasField("prefill") and (plan.decode.id, plan.matched_blocks) == ("f2", 3)
    assert route(CacheAware(), view, exclude=["d1", "d2", "f2"]).decode.id == "f1"
    assert route(CacheAware(), view, exclude=["p2"]).prefill.id == _winner("r", [PD3[0], PD3[2]])
    with pytest.raises(NoWorkersError, match="0 fused .excluded: d1, d2, f1, f2"):
        route(CacheAware(), view, exclude=["d1", "d2", "f1", "f2"])
    with pytest.raises(NoWorkersError):
        route(RoundRobin(), cluster(member("d1", D)))


def test_left_and_expired_members_never_chosen():
    view = cluster(*PD3, cached=CACHED)
    view.apply_membership(Ev(kind=Ev.KIND_LEFT, member=member("p2", P), reason="expired"))
    view.apply_membership(Ev(kind=Ev.KIND_LEFT, member=member("d2", D), reason="deregistered"))
    assert route(CacheAware(), view).prefill.id == "p1"  # p2's longer prefix went with it
    policy = RoundRobin()
    plans = [route(policy, view) for _ in range(3)]
    assert [p.prefill.id + p.decode.id for p in plans] == ["p1d1", "p3d1", "p1d1"]


# -- service -----------------------------------------------------------------------------
def test_import_is_torch_free():
    code = "import sys, rtp_serve.services.master.main; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_master_service_routes_by_nats_events(nats_server: str):
    """Real nats-server, nameservice and master; fake workers register and publish events."""
    NS = "master-test"  # the NATS server is shared by the session
    import argparse

    from rtp_serve.services.common.bus import Bus
    from rtp_serve.services.common.naming import NameClient
    from rtp_serve.services.launcher.servers import free_port
    from rtp_serve.services.master import main as master_main
    from rtp_serve.services.nameservice import main as ns_main

    def args_for(module, *argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        module.add_arguments(parser, "test")
        return parser.parse_args(list(argv))

    async def until(predicate, what: str):
        deadline = time.monotonic() + 10
        while not (result := await predicate()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)
        return result

    async def main(nats_url: str):
        ns_address = f"127.0.0.1:{free_port()}"
        ns_args = args_for(ns_main, "--port", ns_address.rsplit(":")[1], "--ttl", "5")
        tasks = [asyncio.create_task(ns_main.serve(ns_args))]
        workers = [NameClient(ns_address) for _ in PD3]
        bus = await Bus.connect(nats_url, "workers")
        try:
            await until(lambda: grpc_util.check_health(ns_address), "nameservice")
            flags = ("--nameservice", ns_address, "--nats-url", nats_url, "--namespace", NS)
            flags += ("--max-local-prefill-tokens", "0")  # 100-token prompts go to prefill
            tasks.append(asyncio.create_task(master_main.serve(args_for(master_main, *flags))))
            masters = await until(lambda: workers[0].list(ns.ROLE_MASTER), "the master")
            for client, m in zip(workers, PD3, strict=True):
                await client.register(m)
            for report in (load("d1", free=5), load("d2", free=50)):
                await bus.publish(subjects.load_report(report.worker_id, NS), report)
            await bus.publish(subjects.kv_events("p3", NS), kv("p3", 1, stored=H[:4]))
            req = master_pb2.RouteRequest(block_hashes=H[:6], num_prompt_tokens=100)
            async with grpc_util.channel(masters[0].address) as ch:
                stub = master_pb2_grpc.MasterStub(ch)

                async def routed_to_cache():
                    with contextlib.suppress(grpc.aio.AioRpcError):  # no members yet
                        plan = await stub.Route(req, timeout=5)
                        # Loads and KV events are handled by separate subscriptions.
                        return plan if (plan.matched_blocks, plan.decode.id) == (4, "d2") else None

                plan = await until(routed_to_cache, "KV events and loads to reach the master")
                assert (plan.prefill.id, plan.decode.id, plan.policy) == ("p3", "d2", "cache_aware")
                assert plan.prefill.address == PD3[2].address

                await workers[2].close()  # p3 deregisters: it must never be chosen again

                async def p3_gone():
                    return (await stub.Route(req, timeout=5)).prefill.id != "p3"

                await until(p3_gone, "p3 to leave")
                picks = {(await stub.Route(req, timeout=5)).prefill.id for _ in range(4)}
                assert picks == {"p1", "p2"}  # spread by the charged work

                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Route(master_pb2.RouteRequest(block_hashes=[b"x"]), timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "block_hashes[0] is 1 bytes" in err.value.details()
                for bad, why in (
                    (dict(packed_block_hashes=H[0] + b"x"), "17 bytes, not a multiple of 16"),
                    (dict(packed_block_hashes=H[0], block_hashes=[H[0]]), "both set"),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Route(master_pb2.RouteRequest(**bad), timeout=5)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert why in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Route(master_pb2.RouteRequest(exclude=["d1", "d2"]), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "no workers available" in err.value.details()
        finally:
            for client in workers:
                await client.close()
            for task in reversed(tasks):  # master first, then the nameservice
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await bus.close()

    asyncio.run(main(nats_server))


def test_lora_requests_go_to_workers_serving_the_adapter_resident_first():
    def lora_route(view, lora: str) -> master_pb2.RoutePlan:
        req = master_pb2.RouteRequest(request_id="r", num_prompt_tokens=100, lora_name=lora)
        plan = CacheAware().route(view, req)
        view.check_integrity()
        return plan

    fused = [member(w, F) for w in ("f1", "f2", "f3")]
    # f1 is idle but does not serve a1; f2 serves it (not resident), f3 has it resident.
    loads = [
        fitted("f1"),
        fitted("f2", queued=10, loras=["a1"]),
        fitted("f3", queued=20, loras=["a1"], resident_loras=["a1"]),
    ]
    # f3's 20 queued tokens beat f2's 10 plus the adapter's load (32 tokens' worth).
    assert lora_route(cluster(*fused, loads=loads), "a1").decode.id == "f3"
    loads[2] = fitted("f3", queued=60, loras=["a1"], resident_loras=["a1"])
    assert lora_route(cluster(*fused, loads=loads), "a1").decode.id == "f2"
    assert lora_route(cluster(*fused, loads=loads), "").decode.id == "f1"
    # Nobody reports it (reports not in yet): every worker is a candidate; it answers itself.
    assert lora_route(cluster(*fused, loads=loads), "a9").decode.id == "f1"
    # PD: the decode side with the adapter resident, even with fewer free blocks.
    pd = [member("p1", P), member("d1", D), member("d2", D)]
    loads = [
        fitted("p1", loras=["a1"], resident_loras=["a1"]),
        load("d1", free=90, loras=["a1"]),
        load("d2", free=40, loras=["a1"], resident_loras=["a1"]),
    ]
    assert lora_route(cluster(*pd, loads=loads), "a1").decode.id == "d2"
    assert lora_route(cluster(*pd, loads=loads), "").decode.id == "d1"


# -- request-id leases -----------------------------------------------------------------------
def test_request_id_leases():
    from rtp_serve.services.master.leases import RequestLeases

    now = [0.0]
    leases = RequestLeases(clock=lambda: now[0], ttl_s=10.0, max_leases=2)
    assert leases.acquire("r1", "f1") is None
    assert leases.acquire("r1", "f1") is None  # a migration: the same frontend renews
    assert leases.acquire("r1", "f2") == "f1"  # a retry through another frontend
    assert leases.acquire("r1", "f2", gone=lambda f: f == "f1") is None  # f1 left: taken over
    assert not leases.release("r1", "f1")  # f1 no longer holds it
    assert leases.release("r1", "f2") and len(leases) == 0
    assert leases.acquire("r2", "f1") is None
    now[0] = 10.5  # expired (a lost release)
    assert leases.acquire("r2", "f2") is None
    assert leases.acquire("r3", "f1") is None and leases.acquire("r4", "f1") is None
    assert len(leases) == 2 and leases.acquire("r2", "f1") is None  # r2 was the oldest: gone


def test_the_master_refuses_an_id_in_flight_through_another_frontend():
    from rtp_serve.services.master.servicer import MasterServicer
    from tests.frontend_fakes import serve_grpc

    async def main() -> None:
        view = cluster(member("w1", F))
        servicer = MasterServicer(view, CacheAware())
        server, address = await serve_grpc(master_pb2_grpc.add_MasterServicer_to_server, servicer)
        try:
            async with grpc_util.channel(address) as ch:
                stub = master_pb2_grpc.MasterStub(ch)

                def req(frontend: str) -> master_pb2.RouteRequest:
                    return master_pb2.RouteRequest(
                        request_id="r", num_prompt_tokens=4, frontend_id=frontend
                    )

                assert (await stub.Route(req("f1"))).decode.id == "w1"
                assert (await stub.Route(req("f1"))).decode.id == "w1"  # its migration
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Route(req("f2"))
                assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
                assert "in flight through another frontend" in refused.value.details()
                reply = await stub.Release(
                    master_pb2.ReleaseRequest(request_id="r", frontend_id="f1")
                )
                assert reply.released
                assert (await stub.Route(req("f2"))).decode.id == "w1"
                # A frontend that left the cluster holds nothing any more.
                view.apply_membership(
                    Ev(kind=Ev.KIND_JOINED, member=member("f2", ns.ROLE_FRONTEND))
                )
                view.apply_membership(Ev(kind=Ev.KIND_LEFT, member=member("f2", ns.ROLE_FRONTEND)))
                assert (await stub.Route(req("f3"))).decode.id == "w1"
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_index_sizes_are_read_on_the_loop_that_owns_the_index():
    """The metrics server scrapes on a thread of its own; reading the index applies the
    batches it holds back, so a read there raced the loop's writes (it corrupted the index
    of a master ingesting a million blocks while scraped). The collector runs the read on
    the index's loop, and answers with the last sizes when the loop does not answer."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from rtp_serve.services.master.metrics import IndexSizeCollector

    readers: list[int] = []
    sizes = {"w-1": 3}

    def read() -> dict[str, int]:
        readers.append(threading.get_ident())
        return dict(sizes)

    async def main() -> tuple[bytes, bytes, bytes, int]:
        registry = CollectorRegistry()
        registry.register(IndexSizeCollector(read, asyncio.get_running_loop(), timeout_s=0.2))
        scraped = await asyncio.to_thread(generate_latest, registry)  # as the server does
        sizes["w-1"] = 5
        on_loop = generate_latest(registry)  # on the loop itself: read at once
        stale: list[bytes] = []
        scrape = threading.Thread(target=lambda: stale.append(generate_latest(registry)))
        scrape.start()
        sizes["w-1"] = 7
        scrape.join(5.0)  # the loop is held: the scrape times out and keeps the last sizes
        await asyncio.sleep(0)  # the held read runs now
        return scraped, on_loop, stale[0], threading.get_ident()

    scraped, on_loop, stale, loop_thread = asyncio.run(main())
    assert len(readers) == 3
    assert b'rtp:index_blocks{worker="w-1"} 3.0' in scraped
    assert b'rtp:index_blocks{worker="w-1"} 5.0' in on_loop
    assert b'rtp:index_blocks{worker="w-1"} 5.0' in stale
    assert readers[:2] == [loop_thread, loop_thread]
    assert set(readers) == {loop_thread}  # the held loop's read ran later, on the loop


def test_the_index_rpc_lists_counts_without_hashes_and_only_the_workers_asked_for():
    from rtp_serve.services.master.servicer import MasterServicer
    from tests.frontend_fakes import serve_grpc

    async def main() -> None:
        view = cluster(member("w1", F), member("w2", F), cached={"w1": H[:3]})
        assert view.apply_kv_events(kv("w2", stored=H[:5], host_stored=H[8:10]))
        server, address = await serve_grpc(
            master_pb2_grpc.add_MasterServicer_to_server, MasterServicer(view, CacheAware())
        )
        try:
            async with grpc_util.channel(address) as ch:
                stub = master_pb2_grpc.MasterStub(ch)
                full = await stub.Index(master_pb2.IndexRequest())
                assert [w.worker_id for w in full.workers] == ["w1", "w2"]
                w2 = full.workers[1]
                assert (w2.num_blocks, w2.num_host_blocks) == (5, 2)
                assert set(w2.block_hashes) == set(H[:5])
                assert set(w2.host_block_hashes) == set(H[8:10])
                counts = await stub.Index(master_pb2.IndexRequest(counts_only=True))
                assert [
                    (w.worker_id, w.num_blocks, len(w.block_hashes)) for w in counts.workers
                ] == [
                    ("w1", 3, 0),
                    ("w2", 5, 0),
                ]
                some = await stub.Index(master_pb2.IndexRequest(worker_ids=["w2", "nobody"]))
                assert [w.worker_id for w in some.workers] == ["w2"]
                assert some.workers[0] == w2
        finally:
            await server.stop(0)

    asyncio.run(main())
