"""The KV tiers around the engine's device pool: T1 below it (engine/host_tier.py), KV fetched
from lower tiers or peers (imported as cached blocks), and a remote prefill's prompt KV.

The engine composes one `KVTiers`; it owns the device pool (whose evictions spill into the
host tier) so the pool and the tier below it are built and kept together.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rtp_serve.core.block_hash import BlockHash
from rtp_serve.core.cost_model import TIER_HOST, CostModel
from rtp_serve.core.outputs import SampledToken
from rtp_serve.engine.block_pool import BlockPool, KVBlock, KVEvent
from rtp_serve.engine.host_tier import HostTier, HostTierStats
from rtp_serve.engine.model_runner import ModelRunner
from rtp_serve.engine.outputs import PromptKV
from rtp_serve.engine.request import Request


class KVTiers:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        host_bytes: int,
        runner: ModelRunner,
        costs: CostModel,
        record_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.runner = runner  # reads and writes the device KV cache
        self.costs = costs  # copy-up times feed the fetch-cost fit
        # T1 below the device pool: blocks evicted from it spill there.
        self.host = HostTier(host_bytes, record_events=record_events) if host_bytes else None
        self.pool = BlockPool(
            num_blocks,
            record_events=record_events,
            on_evict=self._spill if self.host is not None else None,
        )

    # -- host tier ---------------------------------------------------------------------------
    def copy_up_prefix(self, request: Request) -> None:
        """Copy up from the host tier what it holds of `request`'s reusable prompt blocks."""
        # The last prompt token is always computed (its logits give the next token).
        usable = (request.num_prompt_tokens - 1) // self.block_size
        self.copy_up(request.block_hashes[:usable])

    def prepare_admission(self, request: Request) -> None:
        """Right before the scheduler admits `request`: what the host tier or a fetch gave
        it at arrival may have been evicted while it waited; put it back."""
        if request.staged_kv is not None:
            self.import_blocks(request.staged_kv.block_hashes, request.staged_kv.kv)
        if self.host is not None:
            self.copy_up_prefix(request)

    def peek_cached_prefix(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of these keys the device pool or the host tier holds, each
        block in either (the host's are copied up when the request is admitted). It only
        reads their dicts, so any thread may ask while the engine thread steps: the answer
        is a hint that evictions may overtake, as any answer given between steps is by the
        next step."""
        host = self.host
        n = 0
        for h in block_hashes:
            if self.pool.get_cached(h) is None and (host is None or h not in host):
                break
            n += 1
        return n

    def copy_up(self, block_hashes: list[bytes]) -> None:
        """Copy the blocks after the device pool's prefix of these keys up from the host
        tier, as far as it holds them."""
        if self.host is None or not block_hashes:
            return
        held = []
        for h in block_hashes:
            block = self.pool.get_cached(h)
            if block is None:
                break
            held.append(block)
        rest = block_hashes[len(held) :]
        started = time.perf_counter()
        found = self.host.lookup(rest)
        if found:
            self._adopt(rest[: len(found)], found, protect=held)
            seconds = time.perf_counter() - started
            self.costs.observe_fetch(TIER_HOST, seconds, sum(p.nbytes for p in found))

    def _spill(self, block: KVBlock) -> None:
        """The pool is about to reuse a cached block: keep its KV in the host tier."""
        assert self.host is not None and block.block_hash is not None
        kv = self.runner.read_kv([block.block_id], 0, self.block_size)
        self.host.put(block.block_hash, kv)

    # -- KV from lower tiers ---------------------------------------------------------------
    def import_blocks(self, block_hashes: list[bytes], kv: PromptKV) -> int:
        """Put KV fetched from a lower tier into the pool as cached, unreferenced blocks.

        kv covers len(block_hashes) whole blocks (its `start` is ignored). A request submitted
        next hits them like any prefix-cache block (they join the back of the eviction
        queue). Blocks already cached are skipped (and kept: making room for the others
        never evicts them); returns how many were imported.
        """
        bs = self.block_size
        parts = [_block_of(kv, i, bs) for i in range(len(block_hashes))]
        cached = [b for h in block_hashes if (b := self.pool.get_cached(h)) is not None]
        return self._adopt(list(block_hashes), parts, protect=cached)

    def _adopt(
        self, block_hashes: list[bytes], parts: list[PromptKV], protect: list[KVBlock]
    ) -> int:
        """Write one block of KV per key into free blocks and cache them. `protect` (device
        blocks of the same prefix) and the blocks written so far are referenced meanwhile, so
        making room never evicts them; all are released tail first, as a request frees."""
        self.pool.touch(protect)
        held, adopted = list(protect), 0
        try:
            for h, part in zip(block_hashes, parts, strict=True):
                if self.pool.get_cached(h) is not None:
                    continue
                if self.pool.num_free_blocks == 0:
                    break
                (block,) = self.pool.allocate(1)
                held.append(block)
                self.runner.write_kv([block.block_id], part)
                self.pool.cache_block(block, h)
                adopted += 1
        finally:
            self.pool.free(reversed(held))
        return adopted

    # -- PD decode side --------------------------------------------------------------------
    def write_remote_kv(
        self,
        request: Request,
        table: list[int],
        parts: Sequence[PromptKV],
        first: SampledToken,
        vocab_size: int,
    ) -> None:
        """Check that `parts` cover every prompt position of `request` not cached here and
        that `first` is a token id (ValueError), then write them into its blocks `table`."""
        pos = request.num_computed_tokens
        for part in sorted(parts, key=lambda p: p.start):
            if part.start != pos:
                raise ValueError(f"KV for positions from {part.start}, expected from {pos}")
            pos += part.num_tokens
        if pos != request.num_prompt_tokens:
            raise ValueError(
                f"KV ends at position {pos}, the prompt at {request.num_prompt_tokens}"
            )
        if not 0 <= first.token_id < vocab_size:
            raise ValueError(f"first token id {first.token_id} out of range")
        for part in parts:
            self.runner.write_kv(table, part)

    # -- introspection ---------------------------------------------------------------------
    def host_stats(self) -> HostTierStats | None:
        return None if self.host is None else self.host.stats()

    def take_events(self) -> list[KVEvent]:
        """Blocks stored in / removed from the prefix cache (each event names its tier:
        the device pool or the host tier) since the previous call."""
        host = self.host.take_events() if self.host is not None else []
        return self.pool.take_events() + host

    def has_events(self) -> bool:
        """Whether take_events would return any (safe to read beside the engine thread)."""
        return self.pool.has_events() or (self.host is not None and self.host.has_events())

    def cached_hashes(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Every hash the device pool's prefix cache holds, and every one the host tier does."""
        return self.pool.cached_hashes(), self.host.hashes() if self.host is not None else []

    def check_integrity(self) -> None:
        if self.host is not None:
            self.host.check_integrity()


def _block_of(kv: PromptKV, i: int, block_size: int) -> PromptKV:
    """Block i of KV that starts at a block boundary, as KV of positions [0, block_size)."""
    tokens, block = slice(i * block_size, (i + 1) * block_size), slice(i, i + 1)
    k_scale = None if kv.k_scale is None else kv.k_scale[:, block]
    v_scale = None if kv.v_scale is None else kv.v_scale[:, block]
    return PromptKV(0, kv.k[:, tokens], kv.v[:, tokens], k_scale, v_scale)
