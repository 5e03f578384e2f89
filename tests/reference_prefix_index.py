"""The master's prefix index as it was before the compact one: two dicts of sets.

Kept as the reference the property tests (tests/test_prefix_index_compact.py) compare
services.master.prefix_index.PrefixIndex against, and that bench/index_size.py measures
beside it with --impl reference. Same API and semantics, one Python object per pair.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from rtp_serve.services.common.pb import events_pb2

log = logging.getLogger(__name__)

BLOCK_HASH_BYTES = 16


class SimplePrefixIndex:
    def __init__(self, host_tier: bool = True) -> None:
        """The queries answer for the workers' device pools (T0); `host` is the same index
        for their host-memory tiers (T1), fed by the same messages and snapshots."""
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}
        self.host: SimplePrefixIndex | None = (
            SimplePrefixIndex(host_tier=False) if host_tier else None
        )

    # -- queries ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of (worker, hash) pairs."""
        return sum(len(b) for b in self._blocks.values())

    def workers(self) -> list[str]:
        """Workers with entries in either tier."""
        host = self.host.workers() if self.host is not None else []
        return sorted(set(self._blocks) | set(host))

    def sizes(self) -> dict[str, int]:
        """worker id -> number of hashes it holds."""
        return {w: len(hs) for w, hs in self._blocks.items()}

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def hashes(self, worker_id: str) -> set[bytes]:
        """A copy of the hashes held by `worker_id`."""
        return set(self._blocks.get(worker_id, ()))

    def holds(self, worker_id: str, block_hash: bytes) -> bool:
        return worker_id in self._holders.get(block_hash, ())

    def match(self, worker_id: str, hashes: Sequence[bytes], start: int = 0) -> int:
        """Number of leading `hashes[start:]` present on `worker_id` (stops at the first
        miss). `start` instead of a slice: a prompt's keys are thousands, its candidates
        hundreds, and most hold none of it."""
        blocks = self._blocks.get(worker_id)
        if not blocks:
            return 0
        n = start
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        return n - start

    def match_all(self, hashes: Sequence[bytes], worker_ids: Iterable[str]) -> dict[str, int]:
        """`match` for every worker in `worker_ids`, in one pass over `hashes`."""
        result = dict.fromkeys(worker_ids, 0)
        alive = set(result)
        for i, h in enumerate(hashes):
            if not alive:
                break
            holders = self._holders.get(h)
            still = alive & holders if holders else set()
            for worker_id in alive - still:
                result[worker_id] = i
            alive = still
        for worker_id in alive:  # matched every hash
            result[worker_id] = len(hashes)
        return result

    def match_any(self, hashes: Sequence[bytes], holder_ids: Iterable[str]) -> int:
        """Number of leading `hashes` each held by at least one of `holder_ids` in either
        tier (the cache instances: keys are sharded between them, so the remote tier is
        their union, memory and Redis)."""
        ids = set(holder_ids)
        lower = self.host._holders if self.host is not None else {}
        n = 0
        for h in hashes:
            if ids.isdisjoint(self._holders.get(h, ())) and ids.isdisjoint(lower.get(h, ())):
                break
            n += 1
        return n

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
        self, worker_id: str, cleared: bool, removed: Iterable[bytes], stored: Iterable[bytes]
    ) -> None:
        if cleared:
            self._drop_blocks(worker_id)
        self.remove(worker_id, removed)
        self.store(worker_id, stored)

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
        blocks = self._blocks.get(worker_id)
        for h in hashes:
            if len(h) != BLOCK_HASH_BYTES:
                log.warning("ignoring %d-byte block hash from %s", len(h), worker_id)
                continue
            if blocks is None:
                blocks = self._blocks[worker_id] = set()
            blocks.add(h)
            self._holders.setdefault(h, set()).add(worker_id)

    def remove(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        blocks = self._blocks.get(worker_id)
        if not blocks:
            return
        for h in hashes:
            if h not in blocks:
                continue
            blocks.discard(h)
            self._unhold(h, worker_id)
        if not blocks:
            del self._blocks[worker_id]

    def drop_worker(self, worker_id: str) -> None:
        """Forget everything about a worker (it left the cluster), in both tiers."""
        self._drop_blocks(worker_id)
        if self.host is not None:
            self.host.drop_worker(worker_id)

    def _drop_blocks(self, worker_id: str) -> None:
        for h in self._blocks.pop(worker_id, ()):
            self._unhold(h, worker_id)

    def _unhold(self, h: bytes, worker_id: str) -> None:
        holders = self._holders[h]
        holders.discard(worker_id)
        if not holders:
            del self._holders[h]

    # -- invariants ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Both maps hold the same (worker, hash) pairs, and no set is empty."""
        forward = {(w, h) for w, hs in self._blocks.items() for h in hs}
        backward = {(w, h) for h, ws in self._holders.items() for w in ws}
        assert forward == backward, f"index maps disagree: {forward ^ backward}"
        assert all(self._blocks.values()), "empty block set kept for a worker"
        assert all(self._holders.values()), "empty holder set kept for a hash"
        assert all(len(h) == BLOCK_HASH_BYTES for h in self._holders), "malformed hash"
        if self.host is not None:
            self.host.check_integrity()
