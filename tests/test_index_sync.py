"""The master's index resync logic (services.master.index_sync), scripted step by step with
exact expected index contents, states and counters; and load-report expiry in the view."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from rtp_serve.services.common.pb import events_pb2, master_pb2, worker_pb2
from rtp_serve.services.common.pb import nameservice_pb2 as ns
from rtp_serve.services.master import index_sync
from rtp_serve.services.master.cluster import ClusterView
from rtp_serve.services.master.index_sync import Due, IndexSync, ResyncReason, SyncState
from rtp_serve.services.master.policy import CacheAware
from rtp_serve.services.master.prefix_index import PrefixIndex
from tests.test_master import CACHED, PD3, load, member, route

H = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(16)]
Ev = ns.MembershipEvent
LIVE, WANTED, FETCHING = SyncState.LIVE, SyncState.WANTED, SyncState.FETCHING


def ev(seq: int, inc: int = 7, stored=(), removed=(), worker="a") -> events_pb2.KVEvents:
    return events_pb2.KVEvents(
        worker_id=worker, seq=seq, incarnation=inc, stored=stored, removed=removed
    )


def snap(seq: int, hashes, inc: int = 7, worker="a") -> worker_pb2.KVSnapshot:
    return worker_pb2.KVSnapshot(worker_id=worker, incarnation=inc, seq=seq, block_hashes=hashes)


def report(kv_seq: int, inc: int = 7, worker="a") -> events_pb2.LoadReport:
    return events_pb2.LoadReport(worker_id=worker, incarnation=inc, kv_seq=kv_seq)


class Script:
    def __init__(self) -> None:
        self.now = 0.0
        self.index = PrefixIndex()
        self.sync = IndexSync(self.index, clock=lambda: self.now)
        self.wakes = 0
        self.sync.on_wanted = self._wake

    def _wake(self) -> None:
        self.wakes += 1

    def held(self, worker: str = "a") -> set[bytes]:
        self.index.check_integrity()
        self.sync.check_integrity()
        return self.index.hashes(worker)

    def one_due(self) -> Due:
        (due,) = self.sync.due()
        return due


def test_startup_snapshot_then_buffered_batches_replay_in_order():
    s = Script()
    s.sync.track("a", ResyncReason.STARTUP)  # a worker with a history the master missed
    assert s.sync.state("a") == WANTED and s.wakes == 1
    assert s.sync.events(ev(5, stored=[H[0], H[1]]))  # buffered, not applied
    assert s.held() == set()
    due = s.one_due()
    assert due == Due("a", ResyncReason.STARTUP, 1) and s.sync.state("a") == FETCHING
    assert s.sync.due() == []  # one fetch at a time per worker
    assert s.sync.events(ev(6, stored=[H[2]]))
    assert s.sync.events(ev(7, removed=[H[0]]))
    # The snapshot is as of batch 6: batches 5-6 are in it, batch 7 is replayed on top.
    assert s.sync.snapshot(due, snap(6, [H[0], H[1], H[2], H[3]]))
    assert s.held() == {H[1], H[2], H[3]} and s.sync.position("a") == (7, 7)
    assert s.sync.state("a") == LIVE
    st = s.sync.stats
    assert (st.buffered, st.covered, st.applied, st.resyncs) == (3, 2, 1, {"startup": 1})
    assert not s.sync.events(ev(7, stored=[H[9]]))  # a duplicate: stale, ignored
    assert s.sync.stats.stale == 1 and s.held() == {H[1], H[2], H[3]}
    assert not s.sync.snapshot(due, snap(9, [H[9]]))  # a late second reply: not awaited


def test_host_tier_entries_follow_the_same_stream_and_snapshots():
    s = Script()
    s.sync.track("a", ResyncReason.STARTUP)
    due = s.one_due()
    # Batch 4 (covered by the snapshot) and batch 5: the pool evicts H[1] into the host tier.
    assert s.sync.events(ev(4, stored=[H[0], H[1]]))
    batch = ev(5, removed=[H[1]])
    batch.host_stored.append(H[1])
    assert s.sync.events(batch)
    snapshot = snap(4, [H[0], H[1]])
    snapshot.host_block_hashes.append(H[7])
    assert s.sync.snapshot(due, snapshot)
    assert s.held() == {H[0]} and s.index.host.hashes("a") == {H[1], H[7]}
    # The host tier drops H[7]; a restart clears both tiers at once.
    batch = ev(6)
    batch.host_removed.append(H[7])
    assert s.sync.events(batch) and s.index.host.hashes("a") == {H[1]}
    assert s.sync.events(ev(1, inc=9, stored=[H[5]]))
    assert s.held() == {H[5]} and s.index.host.hashes("a") == set()
    assert s.index.workers() == ["a"]
    s.index.drop_worker("a")
    assert s.index.workers() == [] and s.index.host.workers() == []


def test_batch_one_of_a_fresh_worker_needs_no_snapshot():
    s = Script()
    s.sync.track("a", ResyncReason.JOINED)
    due = s.one_due()  # the fetch is under way when the worker's first batch comes
    assert s.sync.events(ev(1, stored=[H[0], H[1]]))
    assert s.sync.state("a") == LIVE and s.held() == {H[0], H[1]}
    assert s.sync.position("a") == (7, 1)
    assert not s.sync.snapshot(due, snap(0, []))  # the reply is no longer needed
    assert s.sync.events(ev(2, removed=[H[0]])) and s.held() == {H[1]}
    # A restart whose batch 1 arrives: the old entries go, batch 1 is the new truth.
    assert s.sync.events(ev(1, inc=9, stored=[H[5]]))
    assert s.held() == {H[5]} and s.sync.position("a") == (9, 1) and s.sync.due() == []
    assert s.sync.stats.resyncs == {"joined": 1, "restart": 1}


def test_gap_resyncs_and_a_failed_fetch_backs_off():
    s = Script()
    s.sync.track("a", ResyncReason.JOINED)
    s.sync.snapshot(s.one_due(), snap(4, [H[0]]))
    assert s.sync.events(ev(5, stored=[H[1]]))
    assert s.held() == {H[0], H[1]}
    assert s.sync.events(ev(7, stored=[H[3]]))  # 6 was lost
    assert s.sync.state("a") == WANTED and s.held() == {H[0], H[1]}  # old entries: hints
    assert s.sync.events(ev(8, removed=[H[0]]))
    due = s.one_due()
    assert (due.reason, due.token) == (ResyncReason.GAP, 2)
    s.sync.failed(due, "UNAVAILABLE")
    assert s.sync.state("a") == WANTED and s.sync.next_due() == 0.5
    s.now = 0.4
    assert s.sync.due() == []
    s.now = 0.5
    due = s.one_due()
    s.sync.failed(due, "UNAVAILABLE")
    assert s.sync.next_due() == 1.5  # doubled
    s.now = 1.5
    due = s.one_due()
    assert due.reason == ResyncReason.GAP  # the reason survives the retries
    # The worker is at batch 7 by the time it answers: 8 is replayed, 7 was covered.
    assert s.sync.snapshot(due, snap(7, [H[0], H[1], H[2], H[3]]))
    assert s.held() == {H[1], H[2], H[3]} and s.sync.position("a") == (7, 8)
    assert s.sync.stats.failures == 2 and s.sync.stats.resyncs == {"joined": 1, "gap": 1}


def test_a_hole_among_the_buffered_batches_starts_another_round():
    s = Script()
    s.sync.track("a", ResyncReason.JOINED)
    due = s.one_due()
    for seq in (3, 4, 6):
        s.sync.events(ev(seq, stored=[H[seq]]))
    assert s.sync.snapshot(due, snap(2, [H[0]]))
    assert s.held() == {H[0], H[3], H[4]} and s.sync.position("a") == (7, 4)
    assert s.sync.state("a") == WANTED  # batch 5 is missing
    due = s.one_due()
    assert due.reason == ResyncReason.GAP
    assert s.sync.snapshot(due, snap(6, [H[0], H[3], H[4], H[5], H[6]]))
    assert s.held() == {H[0], H[3], H[4], H[5], H[6]} and s.sync.state("a") == LIVE


def test_restart_drops_the_old_entries_at_once_and_ignores_stragglers():
    s = Script()
    s.sync.track("a", ResyncReason.JOINED)
    s.sync.snapshot(s.one_due(), snap(3, [H[0], H[1]]))
    assert s.sync.events(ev(2, inc=9, stored=[H[5]]))  # a newer incarnation; 1 was lost
    assert s.held() == set() and s.sync.state("a") == WANTED
    assert not s.sync.events(ev(4, inc=7, stored=[H[2]]))  # the old process, late
    due = s.one_due()
    assert due.reason == ResyncReason.RESTART
    assert not s.sync.snapshot(due, snap(5, [H[2]], inc=7))  # the old one answered: refused
    assert s.sync.state("a") == WANTED and s.sync.stats.failures == 1
    s.now = 1.0
    assert s.sync.snapshot(s.one_due(), snap(1, [H[4]], inc=9))
    assert s.held() == {H[4], H[5]} and s.sync.position("a") == (9, 2)  # 2 replayed
    # An idle worker restarted: only its load report says so.
    s.sync.load(report(0, inc=11))
    assert s.held() == set() and s.sync.state("a") == WANTED
    assert s.sync.stats.wanted == {"joined": 1, "restart": 2}


def test_load_reports_ahead_of_the_index_mean_a_lost_tail():
    s = Script()
    s.sync.track("a", ResyncReason.JOINED)
    s.sync.snapshot(s.one_due(), snap(2, [H[0]]))
    s.sync.load(report(2))
    s.sync.load(report(3))  # batch 3 may still be on its way
    s.now = 0.5
    s.sync.events(ev(3, stored=[H[1]]))
    s.sync.load(report(3))  # it came: caught up
    s.now = 1.0
    s.sync.load(report(4))
    s.now = 1.9
    s.sync.load(report(4))
    assert s.sync.state("a") == LIVE
    s.now = 2.0  # BEHIND_GRACE_S after the first report naming 4: batch 4 was lost
    s.sync.load(report(4))
    assert s.sync.state("a") == WANTED
    due = s.one_due()
    assert due.reason == ResyncReason.BEHIND
    assert s.sync.snapshot(due, snap(4, [H[0], H[1], H[4]]))
    assert s.held() == {H[0], H[1], H[4]} and s.sync.position("a") == (7, 4)


def test_reconnect_during_a_fetch_resyncs_once_more_after_it():
    s = Script()
    s.sync.track("a", ResyncReason.STARTUP)
    s.sync.track("b", ResyncReason.STARTUP)
    due_a, due_b = s.sync.due()
    s.sync.snapshot(due_b, snap(1, [H[1]], worker="b"))
    s.sync.want_all(ResyncReason.RECONNECT)
    assert (s.sync.state("a"), s.sync.state("b")) == (FETCHING, WANTED)
    s.sync.snapshot(due_a, snap(1, [H[0]]))
    assert s.sync.state("a") == WANTED  # its snapshot may predate the outage
    due_a, due_b = s.sync.due()
    assert (due_a.reason, due_b.reason) == (ResyncReason.RECONNECT, ResyncReason.RECONNECT)
    s.sync.snapshot(due_a, snap(2, [H[0], H[2]]))
    s.sync.snapshot(due_b, snap(1, [H[1]], worker="b"))
    assert s.held("a") == {H[0], H[2]} and s.held("b") == {H[1]}
    assert s.sync.stats.resyncs == {"startup": 2, "reconnect": 2}


def test_forgotten_or_rejoined_worker_ignores_the_old_reply():
    s = Script()
    s.sync.track("a", ResyncReason.JOINED)
    due = s.one_due()
    s.sync.forget("a")
    s.sync.track("a", ResyncReason.JOINED)
    assert not s.sync.snapshot(due, snap(1, [H[0]]))
    assert s.held() == set() and s.sync.state("a") == WANTED
    assert s.sync.due(eligible=lambda w: w != "a") == []  # not a member yet: not fetched
    assert not s.sync.snapshot(s.one_due(), snap(1, [H[0]], worker="b"))  # wrong worker
    assert s.sync.stats.failures == 1


def test_buffer_is_bounded(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(index_sync, "MAX_BUFFERED", 3)
    s = Script()
    s.sync.track("a", ResyncReason.JOINED)
    due = s.one_due()
    for seq in range(11, 17):
        s.sync.events(ev(seq, stored=[H[seq - 10]]))
    assert s.sync.stats.overflowed == 3
    s.sync.check_integrity()
    # Batches 11-13 fell out, but the snapshot covers up to 13: nothing is missing.
    assert s.sync.snapshot(due, snap(13, [H[1], H[2], H[3]]))
    assert s.held() == {H[1], H[2], H[3], H[4], H[5], H[6]} and s.sync.state("a") == LIVE


def test_unsequenced_batches_apply_as_they_come():
    s = Script()
    assert s.sync.events(events_pb2.KVEvents(worker_id="x", stored=[H[0]]))
    assert s.held("x") == {H[0]} and s.sync.workers() == []
    with pytest.raises(ValueError):
        s.sync.events(events_pb2.KVEvents(seq=1))


# -- the view: who is tracked, and load-report expiry -------------------------------------
def test_view_tracks_workers_with_startup_then_joined_reasons():
    view = ClusterView(clock=lambda: 0.0)
    # A batch that beats the first membership snapshot: still a worker the master started
    # without (startup), not one that joined later.
    assert view.apply_kv_events(ev(9, stored=[H[1]], worker="p0"))
    view.apply_membership(Ev(kind=Ev.KIND_SNAPSHOT, member=member("p0", ns.ROLE_PREFILL)))
    assert view.sync.stats.wanted == {"startup": 1}
    view.apply_membership(Ev(kind=Ev.KIND_SNAPSHOT, member=member("p1", ns.ROLE_PREFILL)))
    view.apply_membership(Ev(kind=Ev.KIND_SNAPSHOT, member=member("m1", ns.ROLE_MASTER)))
    view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=member("f1", ns.ROLE_FUSED)))
    assert view.sync.workers() == ["f1", "p0", "p1"]  # workers only
    assert view.sync.stats.wanted == {"startup": 2, "joined": 1}
    assert view.apply_kv_events(ev(4, stored=[H[0]], worker="f1"))  # buffered until snapshot
    assert view.index.workers() == []
    view.apply_membership(Ev(kind=Ev.KIND_LEFT, member=member("f1", ns.ROLE_FUSED)))
    assert view.sync.workers() == ["p0", "p1"]
    assert not view.apply_kv_events(ev(5, stored=[H[0]], worker="f1"))  # departed
    view.check_integrity()


def test_stale_load_report_counts_as_unknown_not_idle():
    now = [0.0]
    view = ClusterView(clock=lambda: now[0])
    for m in PD3:
        view.apply_membership(Ev(kind=Ev.KIND_JOINED, member=m))
    for worker_id, hashes in CACHED.items():
        view.apply_kv_events(events_pb2.KVEvents(worker_id=worker_id, stored=hashes))
    for w in ("p1", "p2", "p3", "d1", "d2"):
        view.apply_load(load(w, free=50 if w == "d1" else 10))
    policy = CacheAware()
    assert route(policy, view).prefill.id == "p2"  # the longest prefix, all idle
    now[0] = 0.9
    for w in ("p1", "p3", "d2"):
        # p2 and d1 fall silent; d2 runs as many as d1 was given (a tie on rows)
        view.apply_load(load(w, free=10, running=1 if w == "d2" else 0))
    now[0] = 1.0  # exactly LOAD_TTL_S: still counts
    assert view.load("p2") is not None
    plan = route(policy, view)
    assert (plan.prefill.id, plan.decode.id) == ("p2", "d1")
    now[0] = 1.01  # p2's and d1's reports are stale: unknown, maybe down
    assert view.load("p2") is None and view.load("p1") is not None
    plan = route(policy, view)
    assert (plan.prefill.id, plan.matched_blocks) == ("p1", 2)
    assert plan.decode.id == "d2" and plan.reason.endswith(
        "(free 10 blocks, a slot free, cost 2 rows)"
    )
    now[0] = 5.0  # nobody reports (NATS down): costs from what is known, the prefix again
    plan = route(policy, view)
    assert plan.prefill.id == "p2" and plan.reason.endswith("(no load report)")
    view.check_integrity()


def test_idle_audit_checks_integrity_and_a_failure_resyncs_everyone():
    now = [0.0]
    view = ClusterView(clock=lambda: now[0])
    for w in ("a", "b"):
        view.apply_membership(Ev(kind=Ev.KIND_SNAPSHOT, member=member(w, ns.ROLE_FUSED)))
    view.end_snapshot()
    for w in ("a", "b"):
        (due,) = view.sync.due(lambda x, w=w: x == w)
        assert view.sync.snapshot(due, snap(3, [H[0]], worker=w))
    now[0] = 10.0
    assert view.audit()  # idle and sound
    view.index._h.count[view.index._h.slot["a"]] += 1  # corrupt: a count its holders lack
    request = master_pb2.RouteRequest(request_id="r", block_hashes=[H[0]], num_prompt_tokens=20)
    CacheAware().route(view, request)  # busy: no audit while requests are routed
    now[0] = 12.0
    assert view.audit()
    now[0] = 20.0
    assert not view.audit()
    assert {view.sync.state(w) for w in ("a", "b")} == {WANTED}
    (due,) = view.sync.due(lambda x: x == "a")  # a's snapshot is on its way: no audit
    now[0] = 30.0
    assert view.audit() and view.sync.state("b") == WANTED


def test_a_slow_audit_runs_less_often(monkeypatch):
    """An audit is linear in the index: one that takes longer than AUDIT_SHARE of its
    interval pushes the next one out, so audits never hold the loop more than that."""
    view = ClusterView()
    calls: list[float] = []

    def audit() -> bool:
        calls.append(time.perf_counter())
        time.sleep(0.02)  # a check of a big index
        return True

    monkeypatch.setattr(view, "audit", audit)

    async def main() -> None:
        task = asyncio.create_task(view.audit_forever(interval_s=0.001))
        await asyncio.sleep(0.5)
        task.cancel()

    asyncio.run(main())
    assert len(calls) == 1  # the next waits 0.02 s / AUDIT_SHARE = 2 s, not 1 ms


def test_the_audit_leaves_out_an_index_too_big_to_check_on_the_loop(monkeypatch):
    from rtp_serve.services.master import cluster

    now = [0.0]
    view = ClusterView(clock=lambda: now[0])
    view.apply_membership(Ev(kind=Ev.KIND_SNAPSHOT, member=member("a", ns.ROLE_FUSED)))
    view.end_snapshot()
    (due,) = view.sync.due()
    assert view.sync.snapshot(due, snap(3, H[:3], worker="a"))
    assert len(view.index) == 3
    view.index._h.count[view.index._h.slot["a"]] += 1  # an index fault only its check sees
    now[0] = 10.0
    monkeypatch.setattr(cluster, "AUDIT_MAX_BLOCKS", 2)
    assert view.audit()  # 3 blocks: over the bound, the index is not checked
    monkeypatch.setattr(cluster, "AUDIT_MAX_BLOCKS", 3)
    assert not view.audit()
