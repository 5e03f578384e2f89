"""Keeps the master's prefix index exact: every worker's KVEvents applied in order, and
its part of the index rebuilt from a snapshot whenever the stream cannot be trusted.

Each worker numbers its batches 1, 2, 3, ... within one incarnation (its start time); a
snapshot (Worker.Snapshot) is the worker's whole cache as of batch S. Per worker:

        +-------- gap / behind / restart / reconnect --------+
        v                                                    |
    WANTED --due()--> FETCHING --snapshot(S)--> LIVE --------+
      ^ (backoff)        |                       applies S+1, S+2, ... in order
      +----failed()------+

    WANTED, FETCHING   batches are buffered (bounded), the old entries stay as hints
    snapshot(S)        replace the worker's entries, drop buffered batches <= S, replay
                       the rest through LIVE (a hole among them starts another round)
    batch 1            of an incarnation nothing is held of: the stream from an empty cache
                       (a process starts with none), so it rebuilds the part like a
                       snapshot at seq 0 would, and no fetch is needed

A resync is wanted when:

    startup    the master has no history of the worker: it is in the master's first
               membership snapshot (the master (re)started with an empty index)
    joined     a worker the master first sees later
    gap        a batch skipped numbers (NATS dropped some)
    behind     load reports name a batch that has not come for BEHIND_GRACE_S (a lost tail)
    restart    a newer incarnation under the same worker id (its old entries go at once:
               the process that held them is gone)
    reconnect  the master's own NATS connection came back (anything could be missed)
    integrity  the view failed its own integrity check (ClusterView.audit_forever)

`IndexSync` is pure and synchronous (tests script it with exact outcomes); the async loop
that calls Worker.Snapshot is `ClusterView.resync_forever`.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rtp_serve.services.common.pb import events_pb2, worker_pb2
from rtp_serve.services.master import metrics
from rtp_serve.services.master.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

BEHIND_GRACE_S = 1.0  # a few load-report intervals: a batch in flight arrives well within it
MAX_BUFFERED = 4096  # batches kept per worker while its snapshot is fetched
RETRY_BASE_S = 0.5  # first retry of a failed snapshot; doubles up to RETRY_MAX_S
RETRY_MAX_S = 10.0


class SyncState(enum.StrEnum):
    LIVE = "live"
    WANTED = "wanted"
    FETCHING = "fetching"


class ResyncReason(enum.StrEnum):
    STARTUP = "startup"
    JOINED = "joined"
    GAP = "gap"
    BEHIND = "behind"
    RESTART = "restart"
    RECONNECT = "reconnect"
    INTEGRITY = "integrity"


@dataclass(slots=True)
class _Feed:
    state: SyncState
    reason: ResyncReason
    incarnation: int = 0  # 0: not known yet
    seq: int = 0  # the last batch applied (or the snapshot's), within `incarnation`
    buffer: list[events_pb2.KVEvents] = field(default_factory=list)
    not_before: float = 0.0  # WANTED: fetch no earlier (retry backoff)
    failures: int = 0  # consecutive failed fetches
    token: int = 0  # FETCHING: which fetch a reply must belong to
    again: ResyncReason | None = None  # wanted again while FETCHING
    behind_since: float | None = None  # LIVE: first load report ahead of `seq`


@dataclass(slots=True)
class SyncStats:
    applied: int = 0  # batches applied in order
    unsequenced: int = 0  # seq 0 batches (applied as they come)
    stale: int = 0  # dropped: an older incarnation, or a seq not newer than the last
    buffered: int = 0  # held while a snapshot was fetched
    overflowed: int = 0  # dropped from a full buffer
    covered: int = 0  # buffered batches the snapshot already contained
    wanted: Counter[str] = field(default_factory=Counter)  # resyncs asked for, by reason
    resyncs: Counter[str] = field(default_factory=Counter)  # snapshots applied, by reason
    failures: int = 0  # snapshot fetches that failed or were refused


@dataclass(frozen=True, slots=True)
class Due:
    """A snapshot fetch to start: hand `token` back to `snapshot` or `failed`."""

    worker_id: str
    reason: ResyncReason
    token: int


class IndexSync:
    def __init__(self, index: PrefixIndex, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self._clock = clock
        self._feeds: dict[str, _Feed] = {}
        self._tokens = 0
        self.stats = SyncStats()
        self.on_wanted: Callable[[], None] | None = None  # wakes the fetch loop

    # -- queries ---------------------------------------------------------------------------
    def workers(self) -> list[str]:
        return sorted(self._feeds)

    def state(self, worker_id: str) -> SyncState | None:
        feed = self._feeds.get(worker_id)
        return feed.state if feed is not None else None

    def position(self, worker_id: str) -> tuple[int, int]:
        """(incarnation, seq) the index reflects for `worker_id` ((0, 0): unknown)."""
        feed = self._feeds.get(worker_id)
        return (feed.incarnation, feed.seq) if feed is not None else (0, 0)

    def fetching(self) -> bool:
        """Whether some snapshot is being fetched (that worker's part is about to change)."""
        return any(f.state == SyncState.FETCHING for f in self._feeds.values())

    def next_due(self) -> float | None:
        """When the earliest WANTED fetch may start (None: none wanted)."""
        times = [f.not_before for f in self._feeds.values() if f.state == SyncState.WANTED]
        return min(times) if times else None

    # -- membership ------------------------------------------------------------------------
    def track(self, worker_id: str, reason: ResyncReason) -> None:
        """Start following a worker: its index part is unknown until a snapshot."""
        if worker_id not in self._feeds:
            self._feeds[worker_id] = _Feed(SyncState.WANTED, reason, not_before=self._clock())
            self.stats.wanted[reason] += 1
        self._wake()

    def forget(self, worker_id: str) -> None:
        self._feeds.pop(worker_id, None)

    def want_all(self, reason: ResyncReason) -> None:
        for worker_id in sorted(self._feeds):
            self.want(worker_id, reason)

    def want(self, worker_id: str, reason: ResyncReason) -> None:
        """Resync `worker_id` (already wanted: no-op; being fetched: once more after)."""
        feed = self._feeds.get(worker_id)
        if feed is None:
            return
        if feed.state == SyncState.FETCHING:
            feed.again = feed.again or reason
            return
        if feed.state == SyncState.LIVE:
            feed.state, feed.reason, feed.behind_since = SyncState.WANTED, reason, None
            feed.not_before = self._clock()
            self.stats.wanted[reason] += 1
            log.info("index resync of %s wanted: %s (at seq %d)", worker_id, reason, feed.seq)
        self._wake()

    # -- the event stream ------------------------------------------------------------------
    def events(self, msg: events_pb2.KVEvents) -> bool:
        """Apply or buffer one batch; False if it was dropped as stale."""
        if not msg.worker_id:
            raise ValueError("KVEvents without worker_id")
        if not msg.seq:  # unsequenced (tests, tools): a hint applied as it comes
            self.index.apply(msg)
            self.stats.unsequenced += 1
            return True
        feed = self._feeds.get(msg.worker_id)
        if feed is None:  # not a member yet: buffered until it joins and is snapshotted
            self.track(msg.worker_id, ResyncReason.JOINED)
            feed = self._feeds[msg.worker_id]
        if msg.incarnation < feed.incarnation:
            self.stats.stale += 1  # a straggler from before a restart
            return False
        if feed.state != SyncState.LIVE:
            return self._held(feed, msg)
        return self._live(feed, msg)

    def load(self, report: events_pb2.LoadReport) -> None:
        """A load report names the worker's latest batch: notice a restart or a lost tail
        even when no batch comes."""
        feed = self._feeds.get(report.worker_id)
        if feed is None or feed.state != SyncState.LIVE or not report.incarnation:
            return
        if report.incarnation > feed.incarnation:
            self._restarted(report.worker_id, feed, report.incarnation)
        elif report.incarnation == feed.incarnation and report.kv_seq > feed.seq:
            now = self._clock()
            if feed.behind_since is None:
                feed.behind_since = now
            elif now - feed.behind_since >= BEHIND_GRACE_S:
                log.warning(
                    "index of %s at seq %d, its reports at %d for %.1f s",
                    report.worker_id,
                    feed.seq,
                    report.kv_seq,
                    now - feed.behind_since,
                )
                self.want(report.worker_id, ResyncReason.BEHIND)
        else:
            feed.behind_since = None

    # -- snapshots -------------------------------------------------------------------------
    def due(
        self, eligible: Callable[[str], bool] = lambda _: True, limit: int = 1 << 30
    ) -> list[Due]:
        """Start up to `limit` wanted fetches whose time has come, of `eligible` workers."""
        now = self._clock()
        out: list[Due] = []
        for worker_id in sorted(self._feeds):
            feed = self._feeds[worker_id]
            if len(out) >= limit:
                break
            if feed.state != SyncState.WANTED or feed.not_before > now or not eligible(worker_id):
                continue
            self._tokens += 1
            feed.state, feed.token = SyncState.FETCHING, self._tokens
            out.append(Due(worker_id, feed.reason, feed.token))
        return out

    def snapshot(self, due: Due, snap: worker_pb2.KVSnapshot) -> bool:
        """Rebuild the worker's entries from `snap` and replay what came after it; False if
        the reply is no longer wanted or does not fit (the fetch then counts as failed)."""
        feed = self._fetching(due)
        if feed is None:
            return False
        if snap.worker_id != due.worker_id or snap.incarnation < feed.incarnation:
            # Another process answers at that address, or an older one than we have heard.
            self.failed(due, f"snapshot of {snap.worker_id}/{snap.incarnation} refused")
            return False
        self._rebuild(
            due.worker_id, feed, snap.incarnation, snap.seq, snap.block_hashes,
            snap.host_block_hashes,
        )  # fmt: skip
        return True

    def failed(self, due: Due, error: str) -> None:
        """A fetch did not give a usable snapshot: try again after a backoff."""
        feed = self._fetching(due)
        if feed is None:
            return
        feed.failures += 1
        self.stats.failures += 1
        metrics.master().resync_failed()
        delay = min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (feed.failures - 1))
        feed.state, feed.not_before = SyncState.WANTED, self._clock() + delay
        feed.reason, feed.again = feed.again or feed.reason, None
        log.warning("index resync of %s failed (%s); retry in %.1f s", due.worker_id, error, delay)
        self._wake()

    # -- internals -------------------------------------------------------------------------
    def _rebuild(
        self,
        worker_id: str,
        feed: _Feed,
        incarnation: int,
        seq: int,
        hashes: Iterable[bytes],
        host_hashes: Iterable[bytes] = (),
    ) -> None:
        """Make the worker's entries `hashes` (and `host_hashes` in its host tier), as of
        batch `seq` of `incarnation`, then replay the buffered batches that come after it."""
        hashes = list(hashes)
        self.index.replace(worker_id, hashes, host_hashes)
        buffered, feed.buffer = feed.buffer, []
        feed.state, feed.incarnation, feed.seq = SyncState.LIVE, incarnation, seq
        feed.failures, feed.behind_since = 0, None
        again, feed.again = feed.again, None
        self.stats.resyncs[feed.reason] += 1
        metrics.master().resynced(feed.reason)
        log.info(
            "index of %s resynced (%s): %d blocks at seq %d, %d buffered batches",
            worker_id,
            feed.reason,
            len(hashes),
            seq,
            len(buffered),
        )
        for msg in sorted(buffered, key=lambda m: (m.incarnation, m.seq)):
            if msg.incarnation == feed.incarnation and msg.seq <= feed.seq:
                self.stats.covered += 1
            elif msg.incarnation < feed.incarnation:
                self.stats.stale += 1
            elif feed.state == SyncState.LIVE:
                self._live(feed, msg)
            else:
                self._buffer(feed, msg)  # a hole among them: kept for the next round
        if again is not None:
            self.want(worker_id, again)

    def _held(self, feed: _Feed, msg: events_pb2.KVEvents) -> bool:
        """A batch while the worker's part is not live: buffered; but batch 1 of an
        incarnation we hold nothing of is the whole stream from an empty cache (a process
        starts with none), so it rebuilds the part at once, without a snapshot."""
        self._buffer(feed, msg)
        if msg.seq == 1 and (msg.incarnation > feed.incarnation or feed.seq == 0):
            self._rebuild(msg.worker_id, feed, msg.incarnation, 0, ())
        return True

    def _live(self, feed: _Feed, msg: events_pb2.KVEvents) -> bool:
        if msg.incarnation > feed.incarnation:
            self._restarted(msg.worker_id, feed, msg.incarnation)
            return self._held(feed, msg)
        if msg.seq <= feed.seq:
            self.stats.stale += 1
            return False
        if msg.seq > feed.seq + 1:
            log.warning(
                "kv events from %s skipped seq %d..%d", msg.worker_id, feed.seq + 1, msg.seq - 1
            )
            self.want(msg.worker_id, ResyncReason.GAP)
            return self._held(feed, msg)
        self.index.apply(msg)
        feed.seq = msg.seq
        self.stats.applied += 1
        return True

    def _restarted(self, worker_id: str, feed: _Feed, incarnation: int) -> None:
        log.info(
            "worker %s restarted (incarnation %d -> %d)", worker_id, feed.incarnation, incarnation
        )
        self.index.drop_worker(worker_id)
        feed.incarnation, feed.seq = incarnation, 0
        self.want(worker_id, ResyncReason.RESTART)

    def _buffer(self, feed: _Feed, msg: events_pb2.KVEvents) -> None:
        if len(feed.buffer) >= MAX_BUFFERED:
            feed.buffer.pop(0)  # its hole shows up on replay, and starts another round
            self.stats.overflowed += 1
        feed.buffer.append(msg)
        self.stats.buffered += 1

    def _fetching(self, due: Due) -> _Feed | None:
        feed = self._feeds.get(due.worker_id)
        if feed is None or feed.state != SyncState.FETCHING or feed.token != due.token:
            return None  # forgotten, or rejoined since: this reply is not the one awaited
        return feed

    def _wake(self) -> None:
        if self.on_wanted is not None:
            self.on_wanted()

    # -- invariants ------------------------------------------------------------------------
    def check_integrity(self, members: Iterable[str] | None = None) -> None:
        """Every feed is in a coherent state; with `members`, the index holds only workers
        that are followed."""
        for worker_id, feed in self._feeds.items():
            assert feed.seq >= 0 and feed.incarnation >= 0, f"{worker_id}: negative position"
            assert len(feed.buffer) <= MAX_BUFFERED, f"{worker_id}: buffer over its bound"
            if feed.state == SyncState.LIVE:
                assert not feed.buffer, f"{worker_id}: live with buffered batches"
                assert feed.again is None, f"{worker_id}: live with a resync pending"
            else:
                assert feed.behind_since is None, f"{worker_id}: behind while not live"
            if feed.state != SyncState.FETCHING:
                assert feed.again is None, f"{worker_id}: again outside a fetch"
        if members is not None:
            stray = set(self.index.workers()) - set(self._feeds) - set(members)
            assert not stray, f"index holds unfollowed workers: {sorted(stray)}"
