"""The master's view of the cluster: members by role, their latest load, and the prefix index.

`ClusterView` itself is pure and synchronous (tests drive it with scripted events); `follow`
feeds it the nameservice Watch stream, `subscribe` the NATS kv/load subjects, and
`upkeep_forever` runs its timers (resyncs, audit, the event cutoff's cut).

Membership follows the Watch stream. A Watch starts with one SNAPSHOT event per known
member, and starts over after a reconnect; naming.NameClient then reports members that
vanished meanwhile as LEFT. As a second line of defence, members we knew that a new
snapshot does not confirm are dropped when the snapshot ends (at the first non-SNAPSHOT
event); until then they stay routable. LEFT removes a member at once: it is never routed to
again, and its prefix-index entries and load are dropped.

The prefix index is kept exact by `index_sync.IndexSync` (sequence numbers, snapshots);
`resync_forever` is the loop that fetches the snapshots it asks for. A load report counts
for LOAD_TTL_S after it arrives; after that the worker's load is unknown (`load` is None),
which the policies treat as "maybe down", never as idle. Whenever nothing was routed for
an audit interval, `audit` runs `check_integrity`; a failure resyncs every worker's part.

With an event cutoff (master replicas, --event-cutoff-ms) the view counts every event from
its stamp, not its arrival (services/master/held_events.py): its time (`now`) is then the
cut, in unix seconds, that the counted events reach; the load TTL, the charges' expiry and
what a report clears are reckoned from stamps, so replicas holding the same events hold
the same view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from rtp_serve.services.common import grpc_util, subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.naming import WORKER_ROLES
from rtp_serve.services.common.pb import (
    cache_pb2_grpc,
    events_pb2,
    nameservice_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from rtp_serve.services.master import metrics
from rtp_serve.services.master.held_events import HeldEvents, Kind
from rtp_serve.services.master.index_sync import Due, IndexSync, ResyncReason
from rtp_serve.services.master.load_table import LoadTable
from rtp_serve.services.master.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

Member = nameservice_pb2.Member
MembershipEvent = nameservice_pb2.MembershipEvent
_MAX_DEPARTED = 4096  # ids remembered so late NATS events of a gone worker are ignored
# Charged work is forgotten this long after it was routed, even without a LoadReport
# (without NATS none ever comes): by then the worker has it, or has finished it.
PENDING_TTL_S = 2.0
# A LoadReport counts only the requests that had reached the worker's engine when it was
# made: one routed this recently may still be on its way (the frontend's call, the engine's
# current step), so its charge outlives the report. One report interval: counting a request
# twice for that long errs towards spreading a burst, forgetting it piles the burst up.
IN_TRANSIT_S = 0.25
# A load report stops counting after this long: workers report every 0.25 s while their load
# changes and at least every 0.4 s while it does not (services/worker/kv_events.py), so one
# lost report does not make a worker unknown. Without reports a worker is unknown, not idle.
LOAD_TTL_S = 1.0
# Under an event cutoff, a request stamped further ahead of this master's clock counts as
# stamped this far ahead (hosts' clocks are synchronized to milliseconds, not seconds).
MAX_CLOCK_AHEAD_S = 0.5
# Members whose KV the prefix index follows: the workers, and the cache instances' T2.
INDEXED_ROLES = WORKER_ROLES | {nameservice_pb2.ROLE_CACHE}
SNAPSHOT_TIMEOUT_S = 5.0
AUDIT_INTERVAL_S = 5.0  # the idle-time integrity check
AUDIT_SHARE = 0.01  # of the loop's time, at most, spent in audits
AUDIT_MAX_BLOCKS = 250_000  # a bigger index is left out of the audit (about 0.2 s here)
# A NATS subscription hands its queued messages to its handler back to back without
# returning to the event loop, so a burst of KV events or load reports from a thousand
# workers would hold every Route call behind it: ingest yields to the loop after this much
# work (bench/route_micro.py --ingest measures the difference).
INGEST_SLICE_S = 0.002
_INGEST_GAP_S = 2e-4  # a break this long between two messages: the loop ran other work
# Snapshots fetched at once. A restarted master fetches one per member: at 1,000 workers,
# 4 at a time took 13 s (each a round trip to a busy worker), 64 at a time 4 s
# (bench/scale.py, N = 1,000; docs/operations/scale.md).
MAX_CONCURRENT_SNAPSHOTS = 64

FetchSnapshot = Callable[[Member], Awaitable[worker_pb2.KVSnapshot]]


@dataclass(slots=True)
class Pending:
    """Work routed to a worker that its last LoadReport may not count yet. Reports come a few
    times a second; without this a burst of requests would all pile onto whichever worker
    looked idlest."""

    requests: int = 0
    tokens: int = 0  # prompt tokens it must compute
    blocks: int = 0  # KV blocks it must hold


@dataclass(frozen=True, slots=True)
class _Charge:
    at: float  # clock() when routed
    tokens: int
    blocks: int


class ClusterView:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        load_ttl_s: float = LOAD_TTL_S,
        event_cutoff_s: float = 0.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._load_ttl_s = load_ttl_s
        # Events count from their stamps plus this (0: on arrival), so that master replicas,
        # which receive each a few ms apart, route on the same view (`catch_up`).
        self._cutoff_s = event_cutoff_s
        self._wall = wall
        self._held = HeldEvents()
        self._cut = wall() - 2 * event_cutoff_s  # unix s: events stamped up to here count
        self._members: dict[str, Member] = {}
        self._loads: dict[str, tuple[events_pb2.LoadReport, float]] = {}  # report, arrival
        self._pending: dict[str, deque[_Charge]] = {}  # oldest first
        self._charges: deque[tuple[float, str]] = deque()  # (at, worker) of every charge
        self._by_role: dict[int | None, list[Member]] = {}  # members(role), until a change
        self._unconfirmed: set[str] | None = None  # None: not inside a snapshot
        self._departed: OrderedDict[str, None] = OrderedDict()
        self._started = False  # the first membership snapshot has ended
        self._last_charged = -math.inf  # clock() of the latest routed request
        self._routed: list[tuple[str, int, int]] | None = None  # None: charges not shared
        self._slice_start = self._ingest_end = time.perf_counter()  # ingest's last slice
        self.index = PrefixIndex()
        self.sync = IndexSync(self.index, clock)
        # The loads and pending charges again, as columns for the policies (kept equal).
        self.table = LoadTable()

    # -- queries ---------------------------------------------------------------------------
    def now(self) -> float:
        """The view's time: its clock's, or with an event cutoff the cut (unix seconds)."""
        return self._cut if self._cutoff_s else self._clock()

    @property
    def load_ttl_s(self) -> float:
        return self._load_ttl_s

    @property
    def event_cutoff_s(self) -> float:
        """Events count this long after their stamps (0: on arrival): the routes of that
        long ago are the last this view counts."""
        return self._cutoff_s

    def members(self, role: int | None = None) -> list[Member]:
        """Current members (of `role`, if given), sorted by id so choices are deterministic."""
        cached = self._by_role.get(role)
        if cached is None:
            cached = self._by_role[role] = sorted(
                (m for m in self._members.values() if role is None or m.role == role),
                key=lambda m: m.id,
            )
        return list(cached)

    def member(self, worker_id: str) -> Member | None:
        return self._members.get(worker_id)

    def departed(self, member_id: str) -> bool:
        """Whether `member_id` was a member and left (as far as the view remembers)."""
        return member_id in self._departed

    def load(self, worker_id: str) -> events_pb2.LoadReport | None:
        """The worker's latest load report; None if none came within the load TTL."""
        entry = self._loads.get(worker_id)
        if entry is None or self.now() - entry[1] > self._load_ttl_s:
            return None
        return entry[0]

    def pending(self, worker_id: str) -> Pending:
        """What was routed to the worker and its last report may not count (expired charges
        dropped)."""
        charges = self._expire(worker_id)
        return Pending(len(charges), sum(c.tokens for c in charges), sum(c.blocks for c in charges))

    def expire_charges(self) -> None:
        """Drop every charge older than PENDING_TTL_S (what `pending` does for one worker),
        so that `table` holds what `pending` would say for each; amortized O(1) a charge."""
        now, log = self.now(), self._charges
        while log and now - log[0][0] > PENDING_TTL_S:
            self._expire(log.popleft()[1])

    def _expire(
        self, worker_id: str, age_s: float = PENDING_TTL_S, now: float | None = None
    ) -> deque[_Charge]:
        """The worker's charges less those older than `age_s` at `now` (by default the
        view's; and PENDING_TTL_S: also where nothing asks for them, a policy that ignores
        load, a cluster without NATS)."""
        charges = self._pending.get(worker_id)
        if charges is None:
            return deque()
        now = self.now() if now is None else now
        while charges and now - charges[0].at > age_s:
            c = charges.popleft()
            self.table.add_pending(worker_id, -1, -c.tokens, -c.blocks)
        return charges

    def charge(
        self,
        worker_id: str,
        tokens: int = 0,
        blocks: int = 0,
        *,
        here: bool = True,
        unix_ms: int = 0,
    ) -> None:
        """Count a request just routed to `worker_id` until a LoadReport made after it
        reached the worker (see IN_TRANSIT_S) or PENDING_TTL_S. `here`: routed by this
        master (kept for `take_routed` while charges are shared), not by another replica.
        `unix_ms`: the request's stamp, from which it counts under an event cutoff (0: the
        wall clock's now)."""
        self._last_charged = self._clock()
        if worker_id not in self._members:
            return
        if here and self._routed is not None:
            self._routed.append((worker_id, tokens, blocks, unix_ms))
        if self._cutoff_s:
            stamp = unix_ms / 1000 if unix_ms else self._wall()
            self._held.push(stamp, Kind.CHARGE, (worker_id, tokens, blocks))
            return
        self._count_charge(worker_id, tokens, blocks, self._clock())

    def _count_charge(self, worker_id: str, tokens: int, blocks: int, at: float) -> None:
        if worker_id not in self._members:
            return  # left while the charge was held
        self._pending.setdefault(worker_id, deque())
        self._expire(worker_id).append(_Charge(at, tokens, blocks))
        self.table.add_pending(worker_id, 1, tokens, blocks)
        self._charges.append((at, worker_id))
        self.expire_charges()  # bounds the log where no route asks (tests charge directly)

    def share_charges(self) -> None:
        """Keep the charges of this master's routes for `take_routed` from now on."""
        if self._routed is None:
            self._routed = []

    def take_routed(self) -> list[tuple[str, int, int, int]]:
        """(worker, tokens, blocks, unix_ms) of every charge made here since the last call."""
        if self._routed is None:
            return []
        routed, self._routed = self._routed, []
        return routed

    @property
    def in_snapshot(self) -> bool:
        return self._unconfirmed is not None

    # -- membership ------------------------------------------------------------------------
    def apply_membership(self, event: MembershipEvent) -> None:
        kind = event.kind
        if kind == MembershipEvent.KIND_SNAPSHOT:
            if self._unconfirmed is None:
                self._unconfirmed = set(self._members)
            if event.member.id:  # an empty member marks an empty snapshot
                self._unconfirmed.discard(event.member.id)
                self._add(event.member)
            return
        self.end_snapshot()
        if kind == MembershipEvent.KIND_JOINED:
            self._add(event.member)
        elif kind == MembershipEvent.KIND_LEFT:
            self._remove(event.member.id, event.reason or "left")
        else:
            log.warning("ignoring membership event of kind %d", kind)

    def end_snapshot(self) -> None:
        """Drop the members the latest snapshot did not confirm (no-op outside one)."""
        if self._unconfirmed is None:
            return
        self._started = True
        unconfirmed, self._unconfirmed = self._unconfirmed, None
        for worker_id in sorted(unconfirmed):
            self._remove(worker_id, "absent from snapshot")
        # Events of workers that never joined would otherwise stay forever.
        for worker_id in set(self.index.workers()) | set(self._loads) | set(self.sync.workers()):
            if worker_id not in self._members:
                self._forget(worker_id)

    def _add(self, member: Member) -> None:
        if not member.id:
            log.warning("ignoring member without id: %s", member)
            return
        self._departed.pop(member.id, None)
        if member.id not in self._members:
            log.info("member %s joined (%s at %s)", member.id, _role(member.role), member.address)
        self._members[member.id] = member
        self._by_role.clear()
        self.table.add(member)
        if (entry := self._loads.get(member.id)) is not None:
            self.table.set_load(member.id, *entry)
        if member.role in INDEXED_ROLES:
            # In the first snapshot the master itself is new: it knows nothing of anyone.
            started = self._started or self._unconfirmed is None
            self.sync.track(member.id, ResyncReason.JOINED if started else ResyncReason.STARTUP)

    def _remove(self, worker_id: str, reason: str) -> None:
        if self._members.pop(worker_id, None) is not None:
            log.info("member %s left (%s)", worker_id, reason)
            self._by_role.clear()
        if self._unconfirmed is not None:
            self._unconfirmed.discard(worker_id)
        self._forget(worker_id)
        self._departed[worker_id] = None
        self._departed.move_to_end(worker_id)
        while len(self._departed) > _MAX_DEPARTED:
            self._departed.popitem(last=False)

    def _forget(self, worker_id: str) -> None:
        self.index.drop_worker(worker_id)
        self.sync.forget(worker_id)
        self._loads.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        self.table.remove(worker_id)

    # -- worker events ---------------------------------------------------------------------
    def apply_kv_events(self, events: events_pb2.KVEvents) -> bool:
        """Apply (or, during a resync, buffer) a worker's KV events; False if ignored (a
        gone worker, or stale seq)."""
        if events.worker_id in self._departed:
            return False
        if self._cutoff_s:
            stamp = events.published_unix_ns / 1e9 if events.published_unix_ns else self._wall()
            self._held.push(stamp, Kind.KV, events)
            self._count_up_to(self._wall() - 2 * self._cutoff_s)
            return True
        return self._count_kv_events(events)

    def _count_kv_events(self, events: events_pb2.KVEvents) -> bool:
        if events.worker_id in self._departed:
            return False
        if not self._started and events.seq and self.sync.state(events.worker_id) is None:
            # Before the first membership snapshot ends the master knows nobody: a worker
            # whose batch beats its snapshot entry is one the master (re)started without.
            self.sync.track(events.worker_id, ResyncReason.STARTUP)
        return self.sync.events(events)

    def apply_load(self, report: events_pb2.LoadReport) -> bool:
        if not report.worker_id or report.worker_id in self._departed:
            return False
        if self._cutoff_s:
            stamp = report.unix_ms / 1000 if report.unix_ms else self._wall()
            self._held.push(stamp, Kind.LOAD, report)
            self._count_up_to(self._wall() - 2 * self._cutoff_s)
        else:
            self._count_load(report, self._clock())
        return True

    def catch_up(self, unix_ms: int = 0) -> None:
        """With an event cutoff, before a route: count the events stamped up to the
        request's stamp (`unix_ms`; 0: the wall clock's now) less the cutoff, oldest first.
        Replicas asked the same request then route on the same events, provided each
        received them within the cutoff. Events arriving move the cut only to the wall
        clock less twice the cutoff, so that a request in transit for less than the cutoff
        still finds the cut where its stamp puts it."""
        if self._cutoff_s:
            wall = self._wall()
            # A frontend whose clock runs ahead would stale every load report at once.
            asked = min(unix_ms / 1000, wall + MAX_CLOCK_AHEAD_S) if unix_ms else wall
            self._count_up_to(asked - self._cutoff_s)

    def _count_up_to(self, cut: float) -> None:
        if cut <= self._cut:
            return
        self._cut = cut
        for stamp, kind, event in self._held.due(cut):
            if kind is Kind.LOAD:
                counted = self._loads.get(event.worker_id)
                if event.worker_id in self._departed or (
                    counted is not None and counted[1] > stamp
                ):
                    continue  # gone, or older than the report counted
                self._count_load(event, stamp)
            elif kind is Kind.KV:
                try:
                    self._count_kv_events(event)
                except ValueError as e:
                    log.warning("bad kv events: %s", e)
            else:
                self._count_charge(*event, stamp)

    def _count_load(self, report: events_pb2.LoadReport, at: float) -> None:
        self.sync.load(report)
        self._loads[report.worker_id] = entry = (report, at)
        self.table.set_load(report.worker_id, *entry)
        # The report counts what had reached the worker; what was routed since may not.
        self._expire(report.worker_id, IN_TRANSIT_S, now=at)

    # -- invariants ------------------------------------------------------------------------
    def check_integrity(self, index: bool = True) -> None:
        """Every invariant of the view; `index` False leaves out the prefix index's own
        (linear in its blocks: seconds at ten million)."""
        if index:
            self.index.check_integrity()
        assert all(k == m.id for k, m in self._members.items()), "member keyed by wrong id"
        assert not self._departed.keys() & self._members.keys(), "departed member still present"
        assert not self._departed.keys() & self._loads.keys(), "load kept for departed member"
        assert not self._departed.keys() & set(self.index.workers()), "index kept departed"
        assert self._pending.keys() <= self._members.keys(), "pending work of a non-member"
        if self._unconfirmed is not None:
            assert self._unconfirmed <= self._members.keys(), "unconfirmed non-member"
        assert not self._departed.keys() & set(self.sync.workers()), "sync kept departed"
        sums = {
            w: (len(cs), sum(c.tokens for c in cs), sum(c.blocks for c in cs))
            for w, cs in self._pending.items()
            if cs
        }
        self.table.check(self._members, sums)
        self.sync.check_integrity()

    def audit(self) -> bool:
        """`check_integrity`, when nothing was routed for a whole audit interval and no
        snapshot is being fetched (the index is rebuilding: a restarted master would check
        a million blocks every interval of its resync); a failure is logged, counted, and
        every worker's index part resynced. False if it failed. The index's own check
        holds the loop for as long as it takes (0.8 s at a million blocks on the 2-core box
        measured: the next Route waits for it), so above AUDIT_MAX_BLOCKS only the rest of
        the view is checked; the index is held to its invariants by its property tests."""
        if self._clock() - self._last_charged < AUDIT_INTERVAL_S or self.sync.fetching():
            return True
        try:
            self.check_integrity(index=len(self.index) <= AUDIT_MAX_BLOCKS)
        except AssertionError as exc:
            log.error("cluster view failed its integrity check (%s): resyncing every worker", exc)
            metrics.master().integrity_failed()
            self.sync.want_all(ResyncReason.INTEGRITY)
            return False
        return True

    async def audit_forever(self, interval_s: float = AUDIT_INTERVAL_S) -> None:
        """Audit every `interval_s`, or less often where one audit takes more than
        AUDIT_SHARE of that: the check is linear in the index (about 0.8 s of CPU at a
        million blocks on the 2-core box measured), and it holds the loop while it runs."""
        while True:
            began = time.perf_counter()
            self.audit()
            took = time.perf_counter() - began
            if took > 0.1:
                log.info("audit took %.2f s (%d blocks)", took, len(self.index))
            await asyncio.sleep(max(interval_s, took / AUDIT_SHARE))

    # -- feeding ---------------------------------------------------------------------------
    async def upkeep_forever(self, fetch: FetchSnapshot) -> None:
        """The view's own work beside its feeds, until cancelled: the index resyncs (over
        the workers' Snapshot RPC, `fetch`), the audit, and under an event cutoff the cut's
        timer. One of them failing ends the others (and this)."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.resync_forever(fetch), name="index-resync")
            tasks.create_task(self.audit_forever(), name="view-audit")
            if self._cutoff_s:
                tasks.create_task(self.count_held_forever(), name="held-events")

    async def count_held_forever(self) -> None:
        """Under an event cutoff, move the cut every cutoff to the wall clock less twice the
        cutoff, as arriving events do: when nothing arrives and nothing is routed, the last
        events (a burst's final evictions) still count, and the index's size metrics too."""
        while True:
            await asyncio.sleep(self._cutoff_s)
            self._count_up_to(self._wall() - 2 * self._cutoff_s)

    async def subscribe(self, bus: Bus, namespace: str = "default") -> None:
        """Apply every worker's KV events and load reports from now on; resync every
        worker's index part when the connection comes back after an outage."""
        bus.on_reconnected(self._on_reconnected)
        await bus.subscribe(
            subjects.kv_events_all(namespace), events_pb2.KVEvents, self._on_kv_events
        )
        await bus.subscribe(
            subjects.load_report_all(namespace), events_pb2.LoadReport, self._on_load
        )

    async def follow(self, events: AsyncIterator[MembershipEvent]) -> None:
        """Apply a membership stream until it ends (NameClient.watch never does)."""
        async for event in events:
            self.apply_membership(event)

    async def _on_kv_events(self, msg: events_pb2.KVEvents, headers: dict[str, str]) -> None:
        self._ingest_starts()
        blocks = len(msg.stored) + len(msg.removed) + len(msg.host_stored) + len(msg.host_removed)
        metrics.master().kv_events(blocks, msg.published_unix_ns)
        try:
            self.apply_kv_events(msg)
        except ValueError as e:
            log.warning("bad kv events: %s", e)
        await self._yield_after_a_slice()

    async def _on_load(self, msg: events_pb2.LoadReport, headers: dict[str, str]) -> None:
        self._ingest_starts()
        self.apply_load(msg)
        await self._yield_after_a_slice()

    def _ingest_starts(self) -> None:
        now = time.perf_counter()
        if now - self._ingest_end > _INGEST_GAP_S:
            self._slice_start = now  # not back to back with the last message: a new slice

    async def _yield_after_a_slice(self) -> None:
        """Let the event loop run the calls waiting for it (Route) once ingest has worked
        INGEST_SLICE_S without a break."""
        now = time.perf_counter()
        if now - self._slice_start >= INGEST_SLICE_S:
            await asyncio.sleep(0)
            now = self._slice_start = time.perf_counter()
        self._ingest_end = now

    async def _on_reconnected(self) -> None:
        self.sync.want_all(ResyncReason.RECONNECT)

    # -- resync ----------------------------------------------------------------------------
    async def resync_forever(
        self, fetch: FetchSnapshot, max_concurrent: int = MAX_CONCURRENT_SNAPSHOTS
    ) -> None:
        """Fetch the snapshots `self.sync` wants (from members only), until cancelled."""
        wake = asyncio.Event()
        self.sync.on_wanted = wake.set
        running: set[asyncio.Task[None]] = set()

        async def one(due: Due, member: Member) -> None:
            try:
                snap = await fetch(member)
            except Exception as e:
                self.sync.failed(due, _describe(e))
            else:
                self.sync.snapshot(due, snap)
            wake.set()  # a slot is free, and a retry may be due

        try:
            while True:
                wake.clear()
                free = max_concurrent - len(running)
                for due in self.sync.due(lambda w: w in self._members, free) if free else ():
                    task = asyncio.create_task(one(due, self._members[due.worker_id]))
                    running.add(task)
                    task.add_done_callback(running.discard)
                next_due = self.sync.next_due()
                timeout = None if next_due is None else max(0.01, next_due - self._clock())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout)
        finally:
            self.sync.on_wanted = None
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


class SnapshotClient:
    """Worker.Snapshot (or Cache.Snapshot, for a cache instance) over gRPC: the default
    `FetchSnapshot`."""

    def __init__(self, timeout_s: float = SNAPSHOT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._channels = grpc_util.ChannelCache()

    async def __call__(self, member: Member) -> worker_pb2.KVSnapshot:
        channel = self._channels.get(member.address)
        stub = (
            cache_pb2_grpc.CacheStub(channel)
            if member.role == nameservice_pb2.ROLE_CACHE
            else worker_pb2_grpc.WorkerStub(channel)
        )
        return await stub.Snapshot(worker_pb2.KVSnapshotRequest(), timeout=self.timeout_s)

    async def close(self) -> None:
        await self._channels.close()


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return repr(error)


def _role(role: int) -> str:
    return nameservice_pb2.Role.Name(role) if role in nameservice_pb2.Role.values() else str(role)
