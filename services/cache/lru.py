"""`ByteLRU`: the cache service's in-memory tier (T2), bounded by bytes, not entries.

Keys are block hash keys, values are serialized `rtp.v1.KVBlock` messages. Blocks of one
model all have the same size, but a service may hold several models (namespaces differ
by `extra` in the key), so the capacity is counted in bytes.

    LRU end                                   MRU end
    [k0] -> [k1] -> [k2] -> ... -> [kN]       put/get move a key here
     ^ evicted first when bytes_used > capacity
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from rtp_serve.services.cache.change_log import ChangeLog


@dataclass(slots=True)
class LRUStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0  # puts of a single value larger than the whole capacity


class ByteLRU:
    """An LRU map bytes -> bytes holding at most `capacity_bytes` of values.

    Only value sizes count towards the capacity (keys are 16 bytes against KV blocks of
    kilobytes to megabytes). Not thread-safe: the service uses it from one event loop.
    """

    def __init__(self, capacity_bytes: int, record_events: bool = False) -> None:
        """`record_events`: remember every key stored or removed, for `take_events` (what
        the instance publishes to the master's index, services/cache/kv_feed.py)."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self.stats = LRUStats()
        self._items: OrderedDict[bytes, bytes] = OrderedDict()
        self.changes: ChangeLog | None = ChangeLog() if record_events else None

    def take_events(self) -> list[tuple[bytes, bool]]:
        """(key, stored) for every change since the last call, in order (False: removed)."""
        return self.changes.take() if self.changes is not None else []

    def has_events(self) -> bool:
        """Whether take_events would return any."""
        return bool(self.changes)

    def _record(self, key: bytes, stored: bool) -> None:
        if self.changes is not None:
            self.changes.record(key, stored)

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[bytes]:
        """Keys from the LRU end to the MRU end (the order they would be evicted in)."""
        return list(self._items)

    def contains(self, key: bytes) -> bool:
        """Presence test that neither refreshes the key nor counts a hit or miss."""
        return key in self._items

    def peek(self, key: bytes) -> bytes | None:
        """The value without refreshing it or counting a hit or miss."""
        return self._items.get(key)

    def get(self, key: bytes) -> bytes | None:
        """The value (now most recently used), or None; counts a hit or a miss."""
        value = self._items.get(key)
        if value is None:
            self.stats.misses += 1
            return None
        self._items.move_to_end(key)
        self.stats.hits += 1
        return value

    def put(self, key: bytes, value: bytes) -> list[bytes]:
        """Store `value` as most recently used; returns the keys evicted to make room.

        A value larger than the whole capacity is not stored (evicting everything for it
        would empty the tier for one block) and any older value under `key` is dropped,
        so the cache never serves a stale version.
        """
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes_used -= len(old)
        if len(value) > self.capacity_bytes:
            self.stats.rejected += 1
            if old is not None:
                self._record(key, False)
            return []
        self._items[key] = value
        self.bytes_used += len(value)
        self._record(key, True)
        evicted: list[bytes] = []
        while self.bytes_used > self.capacity_bytes:
            victim, dropped = self._items.popitem(last=False)
            self.bytes_used -= len(dropped)
            evicted.append(victim)
            self._record(victim, False)
        self.stats.evictions += len(evicted)
        return evicted

    def remove(self, key: bytes) -> bool:
        value = self._items.pop(key, None)
        if value is None:
            return False
        self.bytes_used -= len(value)
        self._record(key, False)
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError unless the byte accounting is exact and within capacity."""
        total = sum(len(v) for v in self._items.values())
        if total != self.bytes_used:
            raise AssertionError(f"bytes_used {self.bytes_used} != sum of sizes {total}")
        if self.bytes_used > self.capacity_bytes:
            raise AssertionError(f"bytes_used {self.bytes_used} > capacity {self.capacity_bytes}")
        if self.bytes_used < 0:
            raise AssertionError(f"bytes_used is negative: {self.bytes_used}")
