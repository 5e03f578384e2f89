"""The master's global prefix index: which workers hold which KV block hashes.

Fed by every worker's rtp.v1.KVEvents in order, and resynced from its snapshot, by
services.master.index_sync (which owns the sequence numbers; this is only the sets). Keys
are chained (docs/design.md "KV cache"), so a worker that holds key_i normally holds key_0..key_{i-1}
too; `match` still stops at the first miss, because a prefix with a hole in it is only
reusable up to the hole.

At a thousand workers and ten million (worker, hash) pairs, sets of Python objects cost
about 250 bytes a pair; here everything is numpy arrays indexed by small ints:

    16-byte hash --BlockIds (block_ids.py)--> id --Holders (holders.py)--> worker slots
                                                  <--                  --- worker slot

Each numpy call costs about a microsecond whatever its size, so event batches are not
applied one by one: stores and removes wait in `_pending` (at most PENDING hashes) and
are applied together, in order, by the first call that reads or needs them.

    apply(m1) apply(m2) ... apply(mk)   match_all(...)
       |         |             |            |
       +---------+--- _pending +---> _flush: one intern, one sort of (id, slot, op);
                                     per pair its last op wins; add / drop in bulk

Within one KVEvents message `cleared` applies first, then `removed`, then `stored`;
publishers should net each batch so that a hash appears in at most one list.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from rtp_serve.services.common.pb import events_pb2
from rtp_serve.services.master.block_ids import BlockIds, words
from rtp_serve.services.master.holders import Holders
from rtp_serve.services.master.packed_hashes import BLOCK_HASH_BYTES, PackedHashes

log = logging.getLogger(__name__)

PENDING = 1024  # hashes of event batches kept back, at most, to be applied together
FIRST_CHUNK = 128  # hashes looked up before the first check for the end of the prefix


class PrefixIndex:
    def __init__(self, host_tier: bool = True) -> None:
        """The queries answer for the workers' device pools (T0); `host` is the same index
        for their host-memory tiers (T1), fed by the same messages and snapshots."""
        self._ids = BlockIds()
        self._h = Holders()
        self._pending: list[tuple[str, Sequence[bytes], Sequence[bytes]]] = []
        self._npending = 0
        self.host: PrefixIndex | None = PrefixIndex(host_tier=False) if host_tier else None

    # -- queries ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of (worker, hash) pairs."""
        self._flush()
        return self._h.pairs

    def distinct(self) -> int:
        """Number of distinct hashes held by some worker."""
        self._flush()
        return len(self._ids)

    def workers(self) -> list[str]:
        """Workers with entries in either tier."""
        self._flush()
        host = self.host.workers() if self.host is not None else []
        return sorted(set(self._h.slot) | set(host))

    def sizes(self) -> dict[str, int]:
        """worker id -> number of hashes it holds."""
        self._flush()
        return {w: self._h.count[s] for w, s in self._h.slot.items()}

    def num_blocks(self, worker_id: str) -> int:
        self._flush()
        s = self._h.slot.get(worker_id)
        return 0 if s is None else self._h.count[s]

    def hashes(self, worker_id: str) -> set[bytes]:
        """A copy of the hashes held by `worker_id`."""
        self._flush()
        s = self._h.slot.get(worker_id)
        return set() if s is None else set(self._ids.keys(self._h.held_ids(s)))

    def holds(self, worker_id: str, block_hash: bytes) -> bool:
        self._flush()
        s = self._h.slot.get(worker_id)
        if s is None or len(block_hash) != BLOCK_HASH_BYTES:
            return False
        return bool(self._h.held(self._ids.find(words(block_hash)), s)[0])

    def match(self, worker_id: str, hashes: Sequence[bytes], start: int = 0) -> int:
        """Number of leading `hashes[start:]` present on `worker_id` (stops at the first
        miss). `start` instead of a slice: a prompt's keys are thousands, its candidates
        hundreds, and most hold none of it."""
        self._flush()
        s = self._h.slot.get(worker_id)
        if s is None:
            return 0
        n = 0
        for ids in self._prefix(hashes, start):
            held = self._h.held(ids, s)
            if not held.all():
                return n + int(held.argmin())
            n += len(ids)
        return n

    def match_holders(self, hashes: Sequence[bytes], start: int = 0) -> dict[str, int]:
        """worker id -> number of leading `hashes[start:]` it holds, for every worker that
        holds at least the first: `match_all` without the candidates that hold nothing.
        Costs the matched prefix times its holders, whatever the number of workers."""
        self._flush()
        ids = np.concatenate([np.zeros(0, np.int64), *self._prefix(hashes, start)])
        if not len(ids):
            return {}
        slots, lengths = self._h.runs(ids)
        names = self._h.names
        return {names[s]: n for s, n in zip(slots.tolist(), lengths.tolist(), strict=True)}

    def match_all(self, hashes: Sequence[bytes], worker_ids: Iterable[str]) -> dict[str, int]:
        """`match` for every worker in `worker_ids`, in one pass over `hashes`."""
        result = dict.fromkeys(worker_ids, 0)
        for worker_id, n in self.match_holders(hashes).items():
            if worker_id in result:
                result[worker_id] = n
        return result

    def match_any(self, hashes: Sequence[bytes], holder_ids: Iterable[str]) -> int:
        """Number of leading `hashes` each held by at least one of `holder_ids` in either
        tier (the cache instances: keys are sharded between them, so the remote tier is
        their union, memory and Redis)."""
        holder_ids = list(holder_ids)
        tiers = [t for t in (self, self.host) if t is not None]
        for tier in tiers:
            tier._flush()
        masks = [t._h.slot_mask(holder_ids) for t in tiers]
        n = 0
        for chunk in _chunks(hashes, 0):
            w = words(_packed(chunk))
            present = np.zeros(len(chunk), bool)
            for tier, mask in zip(tiers, masks, strict=True):
                if mask is not None:
                    present |= tier._h.any_of(tier._ids.find(w), mask)
            if not present.all():
                return n + int(present.argmin())
            n += len(chunk)
        return n

    def _prefix(self, hashes: Sequence[bytes], start: int) -> Iterator[np.ndarray]:
        """Ids of `hashes[start:]`, a chunk at a time, up to the first one not here."""
        for chunk in _chunks(hashes, start):
            ids = self._ids.find(words(_packed(chunk)))
            if (ids < 0).any():
                yield ids[: int(ids.argmin())]
                return
            yield ids

    # -- mutations -------------------------------------------------------------------------
    def apply(self, events: events_pb2.KVEvents) -> None:
        """Apply one worker's event batch (its order is index_sync's business)."""
        worker_id = events.worker_id
        if not worker_id:
            raise ValueError("KVEvents without worker_id")
        self._apply(worker_id, events.cleared, events.removed, events.stored)
        if self.host is not None:
            self.host._apply(worker_id, events.cleared, events.host_removed, events.host_stored)

    def _apply(
        self, worker_id: str, cleared: bool, removed: Sequence[bytes], stored: Sequence[bytes]
    ) -> None:
        if cleared:
            self._drop_blocks(worker_id)
        if len(removed) or len(stored):
            self._later(worker_id, removed, stored)

    def replace(
        self, worker_id: str, hashes: Iterable[bytes], host_hashes: Iterable[bytes] = ()
    ) -> None:
        """Make `hashes` exactly what `worker_id`'s pool holds, and `host_hashes` what its
        host tier holds (a resync from its snapshot)."""
        self._drop_blocks(worker_id)
        self.store(worker_id, hashes)
        if self.host is not None:
            self.host.replace(worker_id, host_hashes)

    def store(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        self._later(worker_id, (), list(hashes))

    def remove(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        self._later(worker_id, list(hashes), ())

    def drop_worker(self, worker_id: str) -> None:
        """Forget everything about a worker (it left the cluster), in both tiers."""
        self._drop_blocks(worker_id)
        if self.host is not None:
            self.host.drop_worker(worker_id)

    def _drop_blocks(self, worker_id: str) -> None:
        self._flush()
        s = self._h.slot.get(worker_id)
        if s is not None:
            ids = self._h.held_ids(s)
            self._h.drop(ids, np.full(len(ids), s))
            self._h.release_empty([s])
            self._ids.discard(ids[self._h.nheld(ids) == 0])

    def _later(self, worker_id: str, removed: Sequence[bytes], stored: Sequence[bytes]) -> None:
        self._pending.append((worker_id, removed, stored))
        self._npending += len(removed) + len(stored)
        if self._npending >= PENDING:
            self._flush()

    def _flush(self) -> None:
        """Apply the pending batches, in order: per (hash, worker) its last op wins."""
        if not self._pending:
            return
        pending, self._pending, self._npending = self._pending, [], 0
        hs: list[bytes] = []
        parts: list[tuple[int, int, bool]] = []  # (slot, hashes, stored?)
        for worker_id, removed, stored in pending:
            if len(removed) and (s := self._h.slot.get(worker_id)) is not None:
                removed = _valid(removed)
                hs += removed
                parts.append((s, len(removed), False))
            if len(stored) and (stored := _valid(stored, worker_id)):
                hs += stored
                parts.append((self._h.slot_of(worker_id), len(stored), True))
        if not hs:
            return
        slots_, counts, ops = zip(*parts, strict=True)
        ids = self._ids.intern(words(b"".join(hs)))
        self._h.ensure(self._ids.limit)
        slots = np.repeat(np.array(slots_, np.int64), counts)
        key = ids * len(self._h.names) + slots
        order = np.argsort(key, kind="stable")
        last = np.ones(len(key), bool)
        last[:-1] = key[order[1:]] != key[order[:-1]]
        pick = order[last]  # the last op of each (id, slot): sorted by id
        ids, slots = ids[pick], slots[pick]
        stored = np.repeat(np.array(ops, bool), counts)[pick]
        held = self._h.held(ids, slots)
        drop = ~stored & held
        self._h.drop(ids[drop], slots[drop])
        add = stored & ~held
        self._h.add(ids[add], slots[add])
        self._h.release_empty(slots_)  # emptied, or given for stores that came to nothing
        unheld = ids[self._h.nheld(ids) == 0]
        self._ids.discard(np.unique(unheld))

    # -- invariants ------------------------------------------------------------------------
    def footprint(self) -> dict[str, int]:
        """Bytes held by each part."""
        self._flush()
        return self._ids.nbytes() | self._h.nbytes()

    def check_integrity(self) -> None:
        """The hash table and the ids agree; every id in use has holders, each worker's
        count and log agree with them."""
        self._flush()
        self._ids.check_integrity()
        self._h.check_integrity(self._ids.live_ids())
        if self.host is not None:
            self.host.check_integrity()


def _chunks(hashes: Sequence[bytes], start: int) -> Iterator[Sequence[bytes]]:
    """`hashes[start:]` in growing chunks, up to the first that is not 16 bytes long."""
    size = FIRST_CHUNK
    packed = isinstance(hashes, PackedHashes)  # every one 16 bytes by construction
    while start < len(hashes):
        chunk = hashes[start : start + size]
        if not packed and set(map(len, chunk)) != {BLOCK_HASH_BYTES}:
            chunk = chunk[: next(i for i, h in enumerate(chunk) if len(h) != BLOCK_HASH_BYTES)]
            if chunk:
                yield chunk
            return
        yield chunk
        start += size
        size *= 4


def _packed(hashes: Sequence[bytes]) -> bytes:
    """The hashes back to back (as they are, where they came packed)."""
    return hashes.packed if isinstance(hashes, PackedHashes) else b"".join(hashes)


def _valid(hashes: Iterable[bytes], worker_id: str | None = None) -> list[bytes]:
    """`hashes` without those not 16 bytes long (logged if from `worker_id`)."""
    hs = list(hashes)
    if not set(map(len, hs)) - {BLOCK_HASH_BYTES}:
        return hs
    for h in hs:
        if len(h) != BLOCK_HASH_BYTES and worker_id is not None:
            log.warning("ignoring %d-byte block hash from %s", len(h), worker_id)
    return [h for h in hs if len(h) == BLOCK_HASH_BYTES]
