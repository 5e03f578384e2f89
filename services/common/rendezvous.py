"""Rendezvous (highest random weight) hashing: for a key, every process ranks the same items
the same way, with no shared state, and taking an item away moves only the keys it won.

The frontend orders the masters it asks by it (a request id asks the same master first
everywhere), and the master breaks routing ties among equally good workers by it, so two
master replicas whose tied sets differ by a few workers still agree on every request
those workers do not win (a hash modulo the tied count sends the same request elsewhere
as soon as the counts differ).

A weight is splitmix64's finalizer of the key's hash XOR the item's hash (both 64-bit
BLAKE2b): the scalar form for a few items, the numpy form for a thousand tied workers in a
few microseconds; tests/test_rendezvous.py holds them equal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

MASK = (1 << 64) - 1
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def hash64(name: str) -> int:
    """A name's stable (across processes and restarts) 64-bit hash."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def weight(key: int, item: int) -> int:
    """The weight of `item` (a hash64) for `key` (a hash64)."""
    z = key ^ item
    z = ((z ^ (z >> 30)) * _M1) & MASK
    z = ((z ^ (z >> 27)) * _M2) & MASK
    return z ^ (z >> 31)


def weights(key: int, items: np.ndarray) -> np.ndarray:
    """`weight(key, i)` for every i of `items` (uint64), as uint64 (numpy wraps multiplies)."""
    import numpy as np

    z = items ^ np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def pick(key: str, items: np.ndarray) -> int:
    """The index of the highest weight among `items` (hash64s, uint64) for `key`."""
    return int(weights(hash64(key), items).argmax())


def order(key: str, names: Sequence[str]) -> list[str]:
    """`names` highest weight first for `key`."""
    k = hash64(key)
    return sorted(names, key=lambda n: weight(k, hash64(n)), reverse=True)
