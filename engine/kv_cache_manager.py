"""Per-request block tables over the block pool: prefix lookup, slot allocation, release."""

from __future__ import annotations

from collections import Counter

from rtp_serve.engine.block_pool import BlockPool, KVBlock
from rtp_serve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request have been offered to the prefix cache.
        self._num_hashed: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request that is not yet scheduled.

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_caching:
            return [], 0
        limit = (len(request.token_ids) - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:limit]:
            block = self.pool.get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed: list[KVBlock] | None = None,
        cache: bool = True,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if it can't.

        With `cache`, blocks this step fills are offered to the prefix cache at once (their
        KV is written before anything reads it). A reservation whose KV arrives later from
        another worker passes False and calls `cache_blocks` once it has been written.
        """
        new_computed = new_computed or []
        blocks = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed) * self.block_size
        total = num_computed + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks) - len(new_computed)
        # A prefix hit on an unreferenced block takes it out of the free queue too.
        evictable_hits = sum(1 for b in new_computed if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            return False
        self.pool.touch(new_computed)
        blocks = self._blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        if cache:
            self.cache_blocks(request, total)
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's full blocks within its first `num_tokens` to the prefix cache."""
        if self.enable_caching:
            self._cache_full_blocks(
                request, self._blocks[request.request_id], num_tokens // self.block_size
            )

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        # Blocks whose every token is computed by the end of this step. Their KV is written
        # before any attention reads it within the step, so a later request may share them.
        start = self._num_hashed.get(request.request_id, 0)
        end = min(num_full, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_hashed[request.request_id] = max(start, end)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` slots (rejected drafts held them).

        Such a block holds no token of the request, so it was never offered to the cache.
        """
        blocks = self._blocks[request.request_id]
        tail = blocks[cdiv(num_tokens, self.block_size) :]
        if not tail:
            return
        assert all(b.block_hash is None for b in tail), "a released draft block was cached"
        del blocks[len(blocks) - len(tail) :]
        self.pool.free(reversed(tail))

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        num_hashed = self._num_hashed.pop(request.request_id, 0)
        # Blocks are cached when their step is scheduled. A request preempted later in that
        # same step never computes it, so blocks past its computed tokens hold no valid KV.
        for block in blocks[request.num_computed_tokens // self.block_size : num_hashed]:
            self.pool.uncache(block)
        self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    @property
    def num_requests(self) -> int:
        return len(self._blocks)

    def check_integrity(self) -> None:
        """Pool invariants, and every ref count equals the number of tables holding it."""
        self.pool.check_integrity()
        owners: Counter[int] = Counter()
        for request_id, blocks in self._blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{request_id} holds a block twice: {ids}"
            owners.update(ids)
        for block in self.pool.blocks:
            assert block.ref_cnt == owners[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != owners {owners[block.block_id]}"
            )
