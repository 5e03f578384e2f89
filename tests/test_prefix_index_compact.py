"""The compact PrefixIndex (numpy arrays) answers every query exactly as the reference
(tests/reference_prefix_index.py, two dicts of sets) does, over random event streams:
stores, removes, cleared batches, resyncs, restarts, departures, both tiers."""

from __future__ import annotations

import hashlib
import random
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtp_serve.services.common.pb import events_pb2
from rtp_serve.services.master import block_ids, prefix_index
from rtp_serve.services.master.block_ids import BlockIds, words
from rtp_serve.services.master.holders import INLINE
from rtp_serve.services.master.prefix_index import PrefixIndex
from tests.reference_prefix_index import SimplePrefixIndex


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def table_loops(request, monkeypatch):
    """Every test runs on the compiled table loops and on the numpy ones."""
    if request.param == "compiled" and block_ids.native is None:
        pytest.skip("services/master/csrc/block_table.cpp not compiled")
    monkeypatch.setenv("RTP_SERVE_MASTER_NATIVE", "1" if request.param == "compiled" else "0")
    return request.param


WORKERS = [f"w{i}" for i in range(9)]  # more than INLINE hold the popular hashes
GHOST = "never-seen"


def chain(prompt: int, n: int) -> list[bytes]:
    keys, parent = [], b"\0" * 16
    for i in range(n):
        parent = hashlib.blake2b(parent + bytes([i % 256, prompt]), digest_size=16).digest()
        keys.append(parent)
    return keys


PROMPTS = [chain(p, 12) for p in range(4)] + [chain(9, 150)]  # one crosses lookup chunks
POOL = [h for p in PROMPTS for h in p]
BAD = [b"short", b"x" * 17, b""]


def tiny_tables(index: PrefixIndex) -> PrefixIndex:
    """Start from 2-bucket hash tables, so that growing and rehashing happen early."""
    index._ids = BlockIds(buckets=2)
    if index.host is not None:
        index.host._ids = BlockIds(buckets=2)
    return index


def some_hashes(rng: random.Random) -> list[bytes]:
    kind = rng.random()
    if kind < 0.5:  # a prefix of a prompt, as a worker stores it
        p = rng.choice(PROMPTS)
        start = rng.randrange(len(p)) if rng.random() < 0.3 else 0
        return p[start : start + rng.randrange(1, len(p) + 1)]
    hs = rng.sample(POOL, rng.randrange(0, 20))
    if rng.random() < 0.1:
        hs.insert(rng.randrange(len(hs) + 1), rng.choice(BAD))
    if hs and rng.random() < 0.1:
        hs.append(hs[0])  # the same hash twice in one list
    return hs


def step(rng: random.Random, indexes: list) -> None:
    w = rng.choice(WORKERS)
    kind = rng.random()
    if kind < 0.55:
        msg = events_pb2.KVEvents(
            worker_id=w,
            cleared=rng.random() < 0.05,
            stored=some_hashes(rng),
            removed=some_hashes(rng) if rng.random() < 0.4 else [],
            host_stored=some_hashes(rng) if rng.random() < 0.3 else [],
            host_removed=some_hashes(rng) if rng.random() < 0.2 else [],
        )
        for index in indexes:
            index.apply(msg)
    elif kind < 0.7:
        hs = some_hashes(rng)
        for index in indexes:
            index.remove(w, hs)
    elif kind < 0.8:
        hs, host = some_hashes(rng), some_hashes(rng)
        for index in indexes:
            index.replace(w, hs, host)
    elif kind < 0.88:
        for index in indexes:
            index.drop_worker(w)
    elif kind < 0.94:  # a restart: dropped, then its stream from an empty cache
        hs = some_hashes(rng)
        for index in indexes:
            index.drop_worker(w)
            index.apply(events_pb2.KVEvents(worker_id=w, seq=1, stored=hs))
    else:
        hs = some_hashes(rng)
        for index in indexes:
            index.store(w, hs)


def queries(rng: random.Random) -> list[list[bytes]]:
    qs = [p for p in PROMPTS] + [some_hashes(rng) for _ in range(3)] + [[]]
    qs.append(PROMPTS[0][:5] + [BAD[0]] + PROMPTS[0][5:])
    qs.append(PROMPTS[-1][:140] + PROMPTS[1])  # breaks after the first lookup chunk
    return qs


def assert_same(got: PrefixIndex, want: SimplePrefixIndex, rng: random.Random) -> None:
    got.check_integrity()
    want.check_integrity()
    assert len(got) == len(want)
    assert got.workers() == want.workers()
    for tier_got, tier_want in ((got, want), (got.host, want.host)):
        assert tier_got.sizes() == tier_want.sizes()
        assert len(tier_got) == len(tier_want)
        for w in [*WORKERS, GHOST]:
            assert tier_got.num_blocks(w) == tier_want.num_blocks(w)
            assert tier_got.hashes(w) == tier_want.hashes(w)
            for h in rng.sample(POOL, 10) + BAD[:1]:
                assert tier_got.holds(w, h) == tier_want.holds(w, h)
    everyone = [*WORKERS, GHOST]
    for q in queries(rng):
        for tier_got, tier_want in ((got, want), (got.host, want.host)):
            expect = tier_want.match_all(q, everyone)
            assert tier_got.match_all(q, everyone) == expect
            assert tier_got.match_all(q, WORKERS[:3]) == tier_want.match_all(q, WORKERS[:3])
            assert tier_got.match_holders(q) == {w: n for w, n in expect.items() if n}
            start = rng.randrange(len(q) + 1)
            for w in everyone:
                assert tier_got.match(w, q, start) == tier_want.match(w, q, start)
            holders = {w: n for w in everyone if (n := tier_want.match(w, q, start))}
            assert tier_got.match_holders(q, start) == holders
        for ids in ([], [GHOST], rng.sample(WORKERS, 2), WORKERS):
            assert got.match_any(q, ids) == want.match_any(q, ids)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 40))
def test_random_streams_answer_like_the_reference(seed: int, steps: int):
    rng = random.Random(seed)
    got, want = tiny_tables(PrefixIndex()), SimplePrefixIndex()
    for _ in range(steps):
        step(rng, [got, want])
        if rng.random() < 0.25:
            assert_same(got, want, rng)
    assert_same(got, want, rng)


@pytest.mark.parametrize("pending", [1, 7, prefix_index.PENDING])
def test_long_stream_reuses_ids_and_slots(pending: int, monkeypatch):
    """Batches applied one by one (1), a few together, or as many as the index keeps back."""
    monkeypatch.setattr(prefix_index, "PENDING", pending)
    rng = random.Random(7)
    got, want = tiny_tables(PrefixIndex()), SimplePrefixIndex()
    for i in range(600):
        step(rng, [got, want])
        if i % 50 == 0:
            assert_same(got, want, rng)
    assert_same(got, want, rng)
    for w in WORKERS:  # everyone leaves: nothing is left behind, in either tier
        got.drop_worker(w)
    assert len(got) == len(got.host) == got.distinct() == 0 and got.workers() == []
    got.check_integrity()


def test_popular_hashes_spill_past_the_inline_holders():
    got, want = PrefixIndex(), SimplePrefixIndex()
    for index in (got, want):
        for w in WORKERS:
            index.store(w, PROMPTS[0])
        index.remove(WORKERS[1], PROMPTS[0][3:])  # a hole among the inline holders
        index.remove(WORKERS[-1], PROMPTS[0])  # one of the spilled
    got.check_integrity()  # applies the pending batches
    assert len(got._h._more) == len(PROMPTS[0]) and len(WORKERS) - 2 > INLINE
    assert_same(got, want, random.Random(0))


def test_the_install_compiled_the_master_table():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the master runs the numpy table")
    assert block_ids.native is not None, "pip install -e . did not build _block_table"


def test_block_ids_grow_and_reuse(table_loops):
    ids = BlockIds(buckets=2)
    assert ids.compiled == (table_loops == "compiled")
    first = ids.intern(words(b"".join(PROMPTS[-1])))
    assert sorted(first.tolist()) == list(range(len(PROMPTS[-1])))
    assert (ids.find(words(b"".join(PROMPTS[-1]))) == first).all()
    ids.discard(first[:10])
    assert (ids.find(words(b"".join(PROMPTS[-1][:10]))) == -1).all()
    again = ids.intern(words(b"".join(PROMPTS[0])))
    assert set(first[:10].tolist()) <= set(again.tolist())  # freed ids come back
    ids.check_integrity()
    assert ids.keys(again) == PROMPTS[0]


@pytest.mark.parametrize("n", [INLINE, 40])
def test_match_holders_is_sparse(n: int):
    index = PrefixIndex()
    for i in range(n):
        index.store(f"w{i}", PROMPTS[0][: i % 12 + 1])
    got = index.match_holders(PROMPTS[0])
    assert got == {f"w{i}": i % 12 + 1 for i in range(n)}
    assert index.match_holders(PROMPTS[1]) == {}
    assert index.match_all(PROMPTS[0], ["w0", GHOST]) == {"w0": 1, GHOST: 0}


def test_more_workers_than_int16_slots():
    """Slots past 32,767 turn the holder rows into int32."""
    index = PrefixIndex(host_tier=False)
    many = [f"w{i}" for i in range(2**15 + 3)]
    for w in many:
        index.store(w, PROMPTS[0][:1])
    index.store(many[-1], PROMPTS[0][1:3])
    assert index.match_holders(PROMPTS[0][:3])[many[-1]] == 3
    assert index.match_all(PROMPTS[0][:3], many[-2:]) == {many[-2]: 1, many[-1]: 3}
    assert len(index.match_holders(PROMPTS[0])) == len(many)
    index.drop_worker(many[-1])
    assert index.match(many[-2], PROMPTS[0]) == 1 and len(index) == len(many) - 1


def test_compiled_and_numpy_tables_find_the_same_ids():
    """Interleaved interns and discards, with hashes made to share tags and buckets (the
    confirm path), from a 2-bucket table: both keep the same hashes, each its own ids."""
    if block_ids.native is None:
        pytest.skip("services/master/csrc/block_table.cpp not compiled")
    rng = random.Random(3)
    a, b = BlockIds(buckets=2, compiled_loops=True), BlockIds(buckets=2, compiled_loops=False)
    pool = [rng.randbytes(16) for _ in range(300)]
    pool += [h[:4] + pool[0][4:8] + rng.randbytes(8) for h in pool[:40]]  # pool[0]'s tag
    pool += [pool[1][:12] + rng.randbytes(4) for _ in range(20)]  # pool[1]'s buckets and tag
    held: set[bytes] = set()
    for _ in range(60):
        batch = rng.choices(pool, k=rng.randrange(1, 80))  # repeats within a batch too
        got_a, got_b = a.intern(words(b"".join(batch))), b.intern(words(b"".join(batch)))
        held |= set(batch)
        assert a.keys(got_a) == b.keys(got_b) == batch
        gone = rng.sample(sorted(held), rng.randrange(len(held) // 2 + 1))
        held -= set(gone)
        if gone:
            w = words(b"".join(gone))
            a.discard(a.find(w))
            b.discard(b.find(w))
        query = words(b"".join(pool))
        assert ((a.find(query) >= 0) == (b.find(query) >= 0)).all()
        assert len(a) == len(b) == len(held)
        a.check_integrity()
        b.check_integrity()
