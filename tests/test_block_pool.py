"""Block pool: exact block ids, ref counts and eviction order after each scripted step."""

import pytest

from rtp_serve.engine.block_pool import BlockPool, KVBlock, KVEvent, KVEventKind


def key(i: int) -> bytes:
    return bytes([i]) * 16


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def refs(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def stored(i: int) -> KVEvent:
    return KVEvent(KVEventKind.STORED, key(i))


def removed(i: int) -> KVEvent:
    return KVEvent(KVEventKind.REMOVED, key(i))


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(4)
    assert pool.free_queue_ids() == [0, 1, 2, 3]
    assert (pool.num_free_blocks, pool.num_cached_blocks, pool.usage) == (4, 0, 0.0)
    pool.check_integrity()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_allocate_hands_out_the_front_of_the_queue():
    pool = BlockPool(6)
    assert ids(pool.allocate(2)) == [0, 1]
    assert ids(pool.allocate(3)) == [2, 3, 4]
    assert refs(pool) == [1, 1, 1, 1, 1, 0]
    assert pool.free_queue_ids() == [5]
    assert pool.usage == pytest.approx(5 / 6)
    pool.check_integrity()


def test_freed_blocks_join_the_back_in_the_given_order():
    pool = BlockPool(5)
    b = pool.allocate(4)
    pool.free([b[2], b[0]])
    assert pool.free_queue_ids() == [4, 2, 0]
    pool.check_integrity()
    pool.free([b[3]])
    assert pool.free_queue_ids() == [4, 2, 0, 3]
    assert refs(pool) == [0, 1, 0, 0, 0]
    pool.check_integrity()
    # The next allocation takes the least recently freed blocks, in ascending order.
    assert ids(pool.allocate(3)) == [0, 2, 4]
    assert pool.free_queue_ids() == [3]
    pool.check_integrity()


def test_a_run_freed_tail_first_comes_back_as_a_forward_run():
    """A request frees its blocks tail first; the next request to take them gets them in
    pool order, so its blocks lie one after another as the decode attention reads them."""
    pool = BlockPool(8)
    first = pool.allocate(5)
    assert ids(first) == [0, 1, 2, 3, 4]
    pool.allocate(3)
    pool.free(reversed(first))
    assert pool.free_queue_ids() == [4, 3, 2, 1, 0]
    assert ids(pool.allocate(3)) == [2, 3, 4]  # the three freed first (its tail), forward
    assert ids(pool.allocate(2)) == [0, 1]
    pool.check_integrity()


def test_touch_and_free_move_ref_counts():
    pool = BlockPool(3)
    b0, _ = pool.allocate(2)
    pool.cache_block(b0, key(1))
    pool.free([b0])
    assert pool.free_queue_ids() == [2, 0]
    assert pool.get_cached(key(1)) is b0
    pool.check_integrity()

    pool.touch([b0])  # a prefix hit takes the cached block out of the queue
    assert (b0.ref_cnt, pool.free_queue_ids()) == (1, [2])
    pool.touch([b0])  # a second request shares it
    assert (b0.ref_cnt, pool.free_queue_ids()) == (2, [2])
    pool.check_integrity()

    pool.free([b0])
    assert (b0.ref_cnt, pool.free_queue_ids()) == (1, [2])
    pool.free([b0])
    assert (b0.ref_cnt, pool.free_queue_ids()) == (0, [2, 0])
    assert pool.get_cached(key(1)) is b0  # still cached while unreferenced
    pool.check_integrity()


def test_cached_block_is_evicted_when_reallocated():
    pool = BlockPool(3, record_events=True)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], key(1))
    pool.cache_block(blocks[1], key(2))
    assert pool.take_events() == [stored(1), stored(2)]
    assert pool.take_events() == []
    pool.free(reversed(blocks))  # tail first, as the KV cache manager frees
    assert pool.free_queue_ids() == [2, 1, 0]
    assert (pool.num_free_blocks, pool.num_cached_blocks) == (3, 2)
    pool.check_integrity()

    assert ids(pool.allocate(1)) == [2]  # plain free block: nothing evicted
    assert pool.take_events() == []
    assert ids(pool.allocate(1)) == [1]  # cached block reached the front
    assert pool.get_cached(key(2)) is None
    assert blocks[1].block_hash is None
    assert pool.get_cached(key(1)) is blocks[0]
    assert pool.take_events() == [removed(2)]
    assert (pool.num_free_blocks, pool.num_cached_blocks) == (1, 1)
    pool.check_integrity()


def test_duplicate_hash_first_writer_wins():
    pool = BlockPool(2, record_events=True)
    b0, b1 = pool.allocate(2)
    pool.cache_block(b0, key(1))
    pool.cache_block(b1, key(1))
    assert pool.get_cached(key(1)) is b0
    assert b1.block_hash is None
    pool.cache_block(b0, key(2))  # a block keeps its first hash
    assert (b0.block_hash, pool.get_cached(key(2))) == (key(1), None)
    assert pool.take_events() == [stored(1)]
    pool.check_integrity()


def test_uncache_withdraws_a_hash():
    pool = BlockPool(2, record_events=True)
    b0, b1 = pool.allocate(2)
    pool.cache_block(b0, key(1))
    pool.uncache(b0)
    pool.uncache(b1)  # no hash: nothing happens
    assert (pool.get_cached(key(1)), b0.block_hash, b0.ref_cnt) == (None, None, 1)
    assert pool.take_events() == [stored(1), removed(1)]
    pool.check_integrity()


def test_freeing_a_block_twice_raises():
    pool = BlockPool(2)
    (b0,) = pool.allocate(1)
    pool.free([b0])
    with pytest.raises(RuntimeError, match="block 0"):
        pool.free([b0])
    assert pool.free_queue_ids() == [1, 0]
    pool.check_integrity()


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="cannot allocate 2"):
        pool.allocate(2)
    assert pool.free_queue_ids() == [2]
    assert refs(pool) == [1, 1, 0]
    pool.check_integrity()


def test_reset_prefix_cache_drops_only_unreferenced_blocks():
    pool = BlockPool(3, record_events=True)
    b0, b1, _ = pool.allocate(3)
    pool.cache_block(b0, key(1))
    pool.cache_block(b1, key(2))
    pool.free([b1])
    pool.take_events()
    pool.reset_prefix_cache()
    assert pool.get_cached(key(2)) is None
    assert pool.get_cached(key(1)) is b0  # still held by a request
    assert pool.take_events() == [removed(2)]
    assert pool.free_queue_ids() == [1]
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool = BlockPool(2)
    (b0,) = pool.allocate(1)
    b0.ref_cnt = 0  # dropped behind the pool's back: not in the free queue
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_integrity()
