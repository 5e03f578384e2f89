"""A consistent-hash ring with virtual nodes: which cache instance owns a block hash key.

Each instance is hashed onto a 64-bit circle at VNODES points; a key belongs to the first
point at or after its own position (wrapping around). Adding an instance takes over only
the arcs in front of its points, about 1/N of the keys, all of them from the others; removing
one hands only its own keys to their next points. The other instances' LRUs stay warm.

    0 ------ a#3 --- b#0 ---------- a#1 -- c#2 ------ b#4 ------- 2^64
       k1 ->  a        k2 -> b     k3 -> a      k4 -> c      k5 -> (wraps) a#3 ...

Virtual nodes even out the arcs: with 160 per instance each one's share stays within a
few tenths of 1/N. Block hash keys are already uniform (blake2b), so a key's position is its
first 8 bytes; instance points hash "address#i".
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

VNODES = 160


def _point(label: str) -> int:
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little")


def key_position(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


class HashRing:
    """Immutable: build a new ring when the set of nodes changes."""

    def __init__(self, nodes: Sequence[str], vnodes: int = VNODES) -> None:
        if vnodes <= 0:
            raise ValueError(f"vnodes must be positive, got {vnodes}")
        self.nodes = sorted(set(nodes))
        points = sorted(
            (_point(f"{node}#{i}"), n) for n, node in enumerate(self.nodes) for i in range(vnodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def __len__(self) -> int:
        return len(self.nodes)

    def index(self, key: bytes) -> int:
        """Position in `nodes` of the instance that owns `key` (there must be one)."""
        if len(self.nodes) == 1:
            return 0
        i = bisect.bisect_left(self._points, key_position(key))
        return self._owners[i if i < len(self._points) else 0]

    def node(self, key: bytes) -> str:
        return self.nodes[self.index(key)]
