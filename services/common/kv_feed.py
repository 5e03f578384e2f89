"""One member's part of the master's prefix index: its KV changes published as numbered
rtp.v1.KVEvents batches, and the snapshot (rtp.v1.KVSnapshot) the master resyncs from
(services/master/index_sync.py).

Batches are numbered 1, 2, 3, ... within one incarnation (the process's start time), and a
number is spent even when NATS drops the batch: that hole is how the master learns it
missed something. A snapshot drains the pending changes into the next batch in the same
step that lists what is held, under the lock that orders batches, so

    snapshot(seq=S) == apply(batch 1..S)        and batches > S hold only later changes

which is all the master needs to replace its entries and then replay what comes after.

A member has two tiers in the message: the upper one (`stored`, `removed`, `block_hashes`)
and the lower one (`host_stored`, `host_removed`, `host_block_hashes`). What they are is
the member's own: a worker's device pool and host tier (services/worker/kv_events.py), a
cache instance's memory and Redis (services/cache/kv_feed.py); a subclass says how to take
its changes (`_take`), whether any wait (`_pending`), and what it holds (`_held`).

A flush takes only when `_pending` says changes wait: a look is a list's truth, not a take
(for a worker a take is a call on the engine thread, which wakes it and then the worker's
loop). A member is told of its changes (`notify`: a cache instance by its LRU and Redis
keys, a worker by its engine, AsyncLLM.watch_kv_events) and `run`s the feed, which sleeps
while nothing changes instead of looking 20 times a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import events_pb2, worker_pb2

EVENT_INTERVAL_S = 0.05  # KV events: at most 20 batches a second

Change = tuple[bytes, bool]  # (key, stored); False: removed


@dataclass(slots=True, frozen=True)
class Changes:
    """Changes in order since the last batch, per tier."""

    upper: list[Change] = field(default_factory=list)
    lower: list[Change] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class Held:
    """What a member holds, taken together with the changes pending before it."""

    changes: Changes
    upper: list[bytes]
    lower: list[bytes]


def _split(changes: list[Change]) -> tuple[list[bytes], list[bytes]]:
    # Net the batch: only each key's last change counts (stored then removed = gone).
    last = dict(changes)
    return [k for k, s in last.items() if s], [k for k, s in last.items() if not s]


class KVFeed:
    """Numbers and publishes one member's KV event batches; serves consistent snapshots."""

    def __init__(
        self,
        bus: Bus,
        member_id: str,
        namespace: str = subjects.DEFAULT_NAMESPACE,
        incarnation: int | None = None,
    ) -> None:
        self.bus = bus
        self.member_id = member_id
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.seq = 0  # the last batch numbered (published or dropped)
        self._subject = subjects.kv_events(member_id, namespace)
        self._lock = asyncio.Lock()  # one batch numbered at a time
        self._changed = asyncio.Event()  # set by notify: changes may wait

    async def _take(self) -> Changes:
        """The changes since the previous call."""
        raise NotImplementedError

    def _pending(self) -> bool:
        """Whether `_take` would find changes: cheap, and allowed to miss one that lands as
        it reads (the next flush takes it)."""
        raise NotImplementedError

    async def _held(self) -> Held:
        """The pending changes and everything held after them, in one step."""
        raise NotImplementedError

    async def flush(self) -> None:
        """Publish the changes since the last batch as the next one (none: nothing)."""
        if not self._pending():
            return
        async with self._lock:
            await self._publish(await self._take())

    async def snapshot(self) -> worker_pb2.KVSnapshot:
        """Everything held now, and the batch number it is consistent with."""
        async with self._lock:
            held = await self._held()
            await self._publish(held.changes)  # its batch number is the snapshot's: covered
            return worker_pb2.KVSnapshot(
                worker_id=self.member_id,
                incarnation=self.incarnation,
                seq=self.seq,
                block_hashes=held.upper,
                host_block_hashes=held.lower,
            )

    @contextlib.asynccontextmanager
    async def numbering(self) -> AsyncIterator[int]:
        """Hold the batch numbering: inside, `seq` names the latest batch published, and
        what is published there goes after it."""
        async with self._lock:
            yield self.seq

    def notify(self) -> None:
        """Changes were recorded (from the event loop's thread): `run` flushes them."""
        self._changed.set()

    async def run(self, interval_s: float = EVENT_INTERVAL_S) -> None:
        """Flush what `notify` announces, at once after a quiet spell and then at most once
        every `interval_s`, until cancelled."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            await self.flush()  # NATS down: the batch is dropped, its number spent (a gap)
            await asyncio.sleep(interval_s)

    async def _publish(self, changes: Changes) -> None:
        if not changes.upper and not changes.lower:
            return
        stored, removed = _split(changes.upper)
        host_stored, host_removed = _split(changes.lower)
        self.seq += 1
        msg = events_pb2.KVEvents(
            worker_id=self.member_id,
            seq=self.seq,
            incarnation=self.incarnation,
            stored=stored,
            removed=removed,
            host_stored=host_stored,
            host_removed=host_removed,
            published_unix_ns=time.time_ns(),
        )
        await self.bus.publish(self._subject, msg)
