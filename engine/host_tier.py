"""T1: a host-memory pool of KV blocks below the device pool (T0), per worker.

A cached block the device pool evicts to make room is copied here first (as stored: an int8
cache's blocks with their scales), keyed by its hash; a request whose prefix is found here
has those blocks copied back up before it is scheduled, and hits them like any prefix-cache
block. Least recently used blocks go first when the byte capacity is reached.

    T0 device pool --evict--> T1 host tier --evict--> gone (T2/T3 hold what workers put there)
         ^                        |
         +------- copy up --------+   (LLMEngine._copy_up, at admission and on lookups)

On a CPU both tiers are host memory: T1 is worth having where it is larger than T0 would be
(a worker that keeps its device pool small and fast to scan, or, later, an INT8-compressed
T1 under a bf16 T0). On CUDA it would be pinned memory with asynchronous copies.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.outputs import PromptKV


@dataclass(frozen=True, slots=True)
class HostTierStats:
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int  # blocks found and copied up
    misses: int  # lookups that stopped at a block not held here
    stored: int  # blocks spilled into the tier
    evicted: int  # blocks dropped for capacity


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[BlockHash, PromptKV] = OrderedDict()
        self._used = 0
        self._hits = self._misses = self._stored = self._evicted = 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def put(self, block_hash: BlockHash, kv: PromptKV) -> None:
        """Keep one block's KV (a copy the caller no longer writes), most recent last."""
        size = kv.nbytes
        if size > self.capacity_bytes:
            return
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        while self._used + size > self.capacity_bytes:
            _, old = self._blocks.popitem(last=False)
            self._used -= old.nbytes
            self._evicted += 1
        self._blocks[block_hash] = kv
        self._used += size
        self._stored += 1

    def lookup(self, block_hashes: list[BlockHash]) -> list[PromptKV]:
        """KV of the leading blocks of these keys held here, in order (each refreshed)."""
        found = []
        for h in block_hashes:
            kv = self._blocks.get(h)
            if kv is None:
                self._misses += 1
                break
            self._blocks.move_to_end(h)
            found.append(kv)
        self._hits += len(found)
        return found

    def stats(self) -> HostTierStats:
        return HostTierStats(
            self.capacity_bytes,
            self._used,
            len(self._blocks),
            self._hits,
            self._misses,
            self._stored,
            self._evicted,
        )

    def check_integrity(self) -> None:
        used = sum(kv.nbytes for kv in self._blocks.values())
        assert used == self._used, f"host tier counts {self._used} bytes, holds {used}"
        assert used <= self.capacity_bytes, "host tier over capacity"
