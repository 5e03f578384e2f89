"""The block pool: owns every KV block, the free queue, the hash map and the ref counts.

Nothing else touches ref counts. A block is in exactly one of three states:

    in use   ref_cnt > 0                 owned by one or more requests
    cached   ref_cnt == 0, has a hash    reusable on a prefix hit until evicted
    free     ref_cnt == 0, no hash

Cached and free blocks together form the free queue, ordered for eviction: the front is
evicted first. Freed blocks join at the back, so the queue is least-recently-used first;
callers free a request's blocks tail first, so its tail goes before its head.

`allocate` takes the blocks at the front and hands them out in ascending block order: a
request's earlier blocks come back reversed, and a run of them given to a new request
in that order would put each of its blocks just before the previous one in memory, where
the decode attention reads them after a jump each instead of as one stream
(kernels/csrc/paged_decode.cpp).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from rtp_serve.core.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class KVEventKind(Enum):
    STORED = "stored"
    REMOVED = "removed"


class KVTier(Enum):
    DEVICE = "device"  # T0: this pool
    HOST = "host"  # T1: engine/host_tier.py


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: KVEventKind
    block_hash: BlockHash
    tier: KVTier = KVTier.DEVICE


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        record_events: bool = False,
        on_evict: Callable[[KVBlock], None] | None = None,
    ) -> None:
        """`on_evict(block)` sees a cached block just before allocation reuses it, while it
        still holds its hash and its KV (the engine spills it to the host tier)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._record_events = record_events
        self._events: list[KVEvent] = []
        self._on_evict = on_evict

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + cached-but-unreferenced)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache: what replaying all events so far would give."""
        return list(self._cached)

    def free_queue_ids(self) -> list[int]:
        """Block ids in eviction order (front first). For tests and debugging."""
        return list(self._free)

    # -- mutations -------------------------------------------------------------------------
    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self._on_evict is not None:
                    self._on_evict(block)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        out.sort(key=lambda b: b.block_id)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given (eviction) order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self._record_events:
            self._events.append(KVEvent(KVEventKind.STORED, block_hash))

    def uncache(self, block: KVBlock) -> None:
        """Withdraw a block's hash: the KV it was registered for will never be written."""
        if block.block_hash is not None:
            self._evict(block)

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (e.g. after new weights are loaded)."""
        for block in list(self._free.values()):
            if block.block_hash is not None:
                self._evict(block)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def has_events(self) -> bool:
        """Whether events wait to be taken (a list's truth, safe to read from any thread)."""
        return bool(self._events)

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self._record_events:
            self._events.append(KVEvent(KVEventKind.REMOVED, block.block_hash))
        block.block_hash = None

    # -- invariants ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + cached + in use == total; queue holds exactly the unreferenced blocks."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        negative = [b.block_id for b in self.blocks if b.ref_cnt < 0]
        assert not negative, f"negative ref counts: {negative}"
        unreferenced = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert set(self._free) == unreferenced, "free queue != unreferenced blocks"
        cached_free = sum(1 for b in self._free.values() if b.block_hash is not None)
        plain_free = len(self._free) - cached_free
        assert plain_free + cached_free + in_use == self.num_blocks
        for h, block in self._cached.items():
            assert block.block_hash == h, f"block {block.block_id} indexed under a stale hash"
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert hashed == len(self._cached), "a hashed block is missing from the index"
