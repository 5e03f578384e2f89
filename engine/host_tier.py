"""T1: a host-memory pool of KV blocks below the device pool (T0), per worker.

A cached block the device pool evicts to make room is copied here first (as stored: an int8
cache's blocks with their scales), keyed by its hash; a request whose prefix is found here
has those blocks copied back up before it is scheduled, and hits them like any prefix-cache
block. Least recently used blocks go first when the byte capacity is reached.

    T0 device pool --evict--> T1 host tier --evict--> gone (T2/T3 hold what workers put there)
         ^                        |
         +------- copy up --------+   (KVTiers.copy_up, at admission and on lookups)

On a CPU both tiers are host memory: T1 is worth having where it is larger than T0 would be
(a worker that keeps its device pool small and fast to scan, or, later, an INT8-compressed
T1 under a bf16 T0). On CUDA the slab is pinned memory and spills are asynchronous copies
down: a lookup waits for the latest one (stream order covers every earlier one) before it
reads a slot, and the copies up from pinned memory are asynchronous too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from rtp_serve.core.block_hash import BlockHash
from rtp_serve.engine.block_pool import KVEvent, KVEventKind, KVTier
from rtp_serve.engine.outputs import PromptKV


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
    """A fixed pool of block slots in host memory, allocated once (at the first block, whose
    shapes every later block shares): capacity_bytes // bytes of one block slots. Blocks
    are copied into slots and out again, never allocated one by one: a tier holding
    thousands of long-lived blocks between short-lived activations otherwise fragments
    the heap until the process holds many times its live data (measured: a 256 MiB tier
    under the trace took a fused worker from 1.4 to 8-17 GiB resident)."""

    def __init__(self, capacity_bytes: int, record_events: bool = False) -> None:
        """`record_events`: keep stored/removed events (tier HOST) for `take_events`, as the
        device pool does: the master's index holds this tier too."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._free: list[int] = []
        self._slab: PromptKV | None = None  # [slots, *block shape] per tensor
        self._block_bytes = 0
        self._hits = self._misses = self._stored = self._evicted = 0
        self._record_events = record_events
        self._events: list[KVEvent] = []
        self._copied: torch.cuda.Event | None = None  # CUDA: after the latest spill's copy
        self._pinned = False  # CUDA: the slab is pinned memory

    def hashes(self) -> list[BlockHash]:
        return list(self._slots)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def has_events(self) -> bool:
        """Whether events wait to be taken (a list's truth, safe to read from any thread)."""
        return bool(self._events)

    def _event(self, kind: KVEventKind, block_hash: BlockHash) -> None:
        if self._record_events:
            self._events.append(KVEvent(kind, block_hash, KVTier.HOST))

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def _allocate(self, kv: PromptKV) -> bool:
        """Make the slab for blocks shaped like `kv`; False if not even one fits."""
        num = self.capacity_bytes // kv.nbytes
        if num == 0:
            return False

        pin = self._pinned = kv.k.is_cuda  # host memory the GPU copies to and from async

        def slab(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.empty((num, *t.shape), dtype=t.dtype, pin_memory=pin)

        self._slab = PromptKV(0, slab(kv.k), slab(kv.v), slab(kv.k_scale), slab(kv.v_scale))
        self._block_bytes = kv.nbytes
        self._free = list(reversed(range(num)))
        return True

    def put(self, block_hash: BlockHash, kv: PromptKV) -> None:
        """Keep a copy of one block's KV, most recent last (evicting the least recent)."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        if self._slab is None and not self._allocate(kv):
            return
        slab = self._slab
        if kv.nbytes != self._block_bytes or kv.k.shape != slab.k.shape[1:]:
            raise ValueError(f"block of {tuple(kv.k.shape)} in a tier of {tuple(slab.k.shape)}")
        if not self._free:
            old_hash, old_slot = self._slots.popitem(last=False)
            self._free.append(old_slot)
            self._evicted += 1
            self._event(KVEventKind.REMOVED, old_hash)
        slot = self._free.pop()
        for dst, src in zip(_tensors(slab), _tensors(kv), strict=True):
            if dst is not None:
                dst[slot].copy_(src, non_blocking=src.is_cuda)
        if kv.k.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._slots[block_hash] = slot
        self._stored += 1
        self._event(KVEventKind.STORED, block_hash)

    def lookup(self, block_hashes: list[BlockHash]) -> list[PromptKV]:
        """Copies of the KV of the leading blocks of these keys held here, in order (each
        refreshed). Copies, because storing the caller's next blocks may reuse these slots
        before it has written these up."""
        if self._copied is not None:  # the spills down must have landed before we read
            self._copied.synchronize()
            self._copied = None
        found = []
        for h in block_hashes:
            slot = self._slots.get(h)
            if slot is None:
                self._misses += 1
                break
            self._slots.move_to_end(h)
            found.append(
                PromptKV(0, *(_clone(t, slot, self._pinned) for t in _tensors(self._slab)))
            )
        self._hits += len(found)
        return found

    def stats(self) -> HostTierStats:
        return HostTierStats(
            self.capacity_bytes,
            len(self._slots) * self._block_bytes,
            len(self._slots),
            self._hits,
            self._misses,
            self._stored,
            self._evicted,
        )

    def check_integrity(self) -> None:
        held = list(self._slots.values())
        assert len(set(held)) == len(held), "two blocks in one host-tier slot"
        assert not set(held) & set(self._free), "a host-tier slot both held and free"
        if self._slab is not None:
            num = self._slab.k.shape[0]
            assert sorted(held + self._free) == list(range(num)), "host-tier slots lost"
            assert num * self._block_bytes <= self.capacity_bytes, "host tier over capacity"
        else:
            assert not held, "blocks held without a slab"


def _tensors(kv: PromptKV) -> tuple[torch.Tensor | None, ...]:
    return kv.k, kv.v, kv.k_scale, kv.v_scale


def _clone(t: torch.Tensor | None, slot: int, pinned: bool) -> torch.Tensor | None:
    if t is None:
        return None
    if pinned:  # pinned too, so that its copy up is asynchronous
        return torch.empty_like(t[slot], pin_memory=True).copy_(t[slot])
    return t[slot].clone()
