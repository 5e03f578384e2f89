"""KV cache manager: exact block tables, ref counts and prefix hits per scripted step."""

from rtp_serve.core.block_hash import block_hash_keys
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.engine.block_pool import BlockPool, KVEvent, KVEventKind
from rtp_serve.engine.kv_cache_manager import KVCacheManager
from rtp_serve.engine.request import Request

BS = 4


def make(num_blocks: int = 8, **kw) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, **kw), BS)


def req(rid: str, tokens: list[int], extra: bytes = b"") -> Request:
    return Request(rid, tokens, params=SamplingParams(), block_size=BS, salt=extra)


def run(kv: KVCacheManager, r: Request, n: int) -> None:
    """Allocate `n` more tokens and compute them, as one engine step would."""
    assert kv.allocate_slots(r, n)
    r.num_computed_tokens += n
    kv.check_integrity()


def admit(kv: KVCacheManager, r: Request) -> int:
    """Schedule a new request's whole prompt after a prefix lookup; returns hit tokens."""
    hits, num_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, len(r.token_ids) - num_hit, hits)
    r.num_computed_tokens = len(r.token_ids)
    kv.check_integrity()
    return num_hit


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def cached_ids(kv: KVCacheManager, r: Request) -> list[int | None]:
    """Per block hash of the request: the id of the block cached under it, or None."""
    blocks = [kv.pool.get_cached(h) for h in r.block_hashes]
    return [b.block_id if b else None for b in blocks]


A = list(range(1, 11))  # 10 tokens: two full blocks and a partial one


def test_prompt_then_decode_allocates_blocks_as_tokens_arrive():
    kv = make()
    a = req("a", A)
    run(kv, a, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    assert refs(kv) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert cached_ids(kv, a) == [0, 1]  # the partial block 2 is not cached
    for token, expected in [(11, [0, 1, 2]), (12, [0, 1, 2]), (13, [0, 1, 2, 3])]:
        a.append_token(token)
        run(kv, a, 1)
        assert kv.block_ids("a") == expected
    assert cached_ids(kv, a) == [0, 1, 2]  # block 2 filled up when token 12 was computed
    assert kv.pool.free_queue_ids() == [4, 5, 6, 7]


def test_prefix_hit_shares_full_blocks():
    kv = make()
    a, b = req("a", A), req("b", A[:8] + [50, 51, 52])
    admit(kv, a)
    assert admit(kv, b) == 8
    assert b.block_hashes[:2] == a.block_hashes[:2]
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.block_ids("b") == [0, 1, 3]
    assert refs(kv) == [2, 2, 1, 1, 0, 0, 0, 0]


def test_block_holding_the_last_prompt_token_is_never_hit():
    kv = make()
    admit(kv, req("a", A))
    # The logits of the last prompt token give the first output token, so it is computed.
    assert kv.get_computed_blocks(req("x", A[:8])) == ([kv.pool.blocks[0]], 4)
    assert kv.get_computed_blocks(req("y", A[:9]))[1] == 8
    assert kv.get_computed_blocks(req("z", A[:4])) == ([], 0)
    assert kv.get_computed_blocks(req("w", [9] + A[1:])) == ([], 0)


def test_partial_block_is_never_shared():
    kv = make()
    a = req("a", A[:6])
    admit(kv, a)
    assert kv.block_ids("a") == [0, 1]
    assert kv.pool.blocks[1].block_hash is None
    b = req("b", A[:6] + [7, 8, 60])  # same tokens as a's partial block, then more
    assert admit(kv, b) == 4
    assert kv.block_ids("b") == [0, 2, 3]
    assert refs(kv) == [2, 1, 1, 1, 0, 0, 0, 0]


def test_different_salt_never_hits():
    kv = make()
    admit(kv, req("a", A, extra=b"model-1"))
    assert kv.get_computed_blocks(req("b", A, extra=b"model-2")) == ([], 0)


def test_free_releases_tail_first_and_keeps_full_blocks_cached():
    kv = make()
    a = req("a", A)
    admit(kv, a)
    kv.free(a)
    kv.check_integrity()
    assert kv.block_ids("a") == []
    assert kv.num_requests == 0
    assert kv.pool.free_queue_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert cached_ids(kv, a) == [0, 1]
    # A later request revives the cached blocks from the free queue.
    b = req("b", A[:8] + [70])
    assert admit(kv, b) == 8
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.free_queue_ids() == [4, 5, 6, 7, 2]


def test_shared_block_survives_one_owner_leaving():
    kv = make()
    a, b = req("a", A), req("b", A[:8] + [80])
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.check_integrity()
    assert refs(kv) == [1, 1, 0, 1, 0, 0, 0, 0]
    assert kv.pool.free_queue_ids() == [4, 5, 6, 7, 2]
    kv.free(b)
    kv.check_integrity()
    assert kv.pool.free_queue_ids() == [4, 5, 6, 7, 2, 3, 1, 0]


def test_allocation_failure_leaves_state_unchanged():
    kv = make(num_blocks=4)
    admit(kv, req("a", A))
    b = req("b", [90] * 8)
    assert not kv.allocate_slots(b, 8)  # needs 2 blocks, 1 is free
    assert kv.block_ids("b") == []
    assert refs(kv) == [1, 1, 1, 0]
    assert kv.pool.free_queue_ids() == [3]
    kv.check_integrity()


def test_prefix_hits_on_free_blocks_count_against_free_space():
    kv = make(num_blocks=3)
    a = req("a", A[:8])
    run(kv, a, 8)
    kv.free(a)
    assert kv.pool.free_queue_ids() == [2, 1, 0]
    # Hits blocks 0 and 1, needs 2 more: touching the hits leaves only block 2.
    b = req("b", A[:8] + [1, 2, 3, 4, 5])
    hits, num_hit = kv.get_computed_blocks(b)
    assert ([h.block_id for h in hits], num_hit) == ([0, 1], 8)
    assert not kv.allocate_slots(b, 5, hits)
    assert kv.block_ids("b") == []
    assert refs(kv) == [0, 0, 0]
    assert kv.pool.free_queue_ids() == [2, 1, 0]
    kv.check_integrity()
    # One token past the hit fits in the last block.
    c = req("c", A[:8] + [1])
    assert admit(kv, c) == 8
    assert kv.block_ids("c") == [0, 1, 2]
    assert kv.pool.free_queue_ids() == []


def test_request_preempted_before_its_step_ran_leaves_no_uncomputed_block_cached():
    # Regression: the scheduler may preempt a request it has already scheduled this step.
    # Its blocks were cached at allocation; the ones past its computed tokens hold no KV.
    kv = make(record_events=True)
    a = req("a", A[:6])
    run(kv, a, 6)
    a.append_token(7)
    run(kv, a, 1)
    a.append_token(8)
    assert kv.allocate_slots(a, 1)  # would compute token 8 and fill block 1 ...
    assert cached_ids(kv, a) == [0, 1]
    kv.free(a)  # ... but the request is preempted before the step runs
    kv.check_integrity()
    assert cached_ids(kv, a) == [0, None]
    h0, h1 = a.block_hashes
    assert kv.pool.take_events() == [
        KVEvent(KVEventKind.STORED, h0),
        KVEvent(KVEventKind.STORED, h1),
        KVEvent(KVEventKind.REMOVED, h1),
    ]


def test_caching_disabled_never_hashes_or_hits():
    kv = KVCacheManager(BlockPool(8), BS, enable_caching=False)
    a = req("a", A)
    admit(kv, a)
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(req("b", A)) == ([], 0)


def test_request_block_hashes_grow_with_its_tokens():
    a = req("a", A[:3], extra=b"e")
    assert a.block_hashes == []
    for token in range(4, 14):
        a.append_token(token)
        assert a.block_hashes == block_hash_keys(a.token_ids, BS, b"e")
    assert len(a.block_hashes) == 3
