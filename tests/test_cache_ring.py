"""Consistent hashing of block keys over cache instances (services.cache.ring): adding or
removing an instance moves about 1/N of the keys, and only to or from that instance."""

from __future__ import annotations

import hashlib

import pytest

from rtp_serve.services.cache.client import CacheClient
from rtp_serve.services.cache.ring import HashRing

KEYS = [hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest() for i in range(50_000)]
# A share may stray this far from 1/N: with 160 virtual nodes the arcs' spread is ~8%.
TOLERANCE = 0.25


def owners(ring: HashRing) -> list[str]:
    return [ring.node(k) for k in KEYS]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_adding_an_instance_moves_about_one_nth_all_to_it(n: int):
    nodes = [f"10.0.0.{i}:7000" for i in range(n)]
    before = owners(HashRing(nodes))
    after = owners(HashRing([*nodes, "10.0.0.99:7000"]))
    moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert all(after[i] == "10.0.0.99:7000" for i in moved)  # nothing shuffles between old
    expected = 1 / (n + 1)
    assert abs(len(moved) / len(KEYS) - expected) <= TOLERANCE * expected
    for node in nodes:  # still balanced
        assert abs(after.count(node) / len(KEYS) - expected) <= TOLERANCE * expected


@pytest.mark.parametrize("n", [3, 5])
def test_removing_an_instance_moves_only_its_keys(n: int):
    nodes = [f"cache-{i}:7000" for i in range(n)]
    before = owners(HashRing(nodes))
    gone = nodes[1]
    after = owners(HashRing([a for a in nodes if a != gone]))
    moved = {i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b}
    assert moved == {i for i, a in enumerate(before) if a == gone}
    assert abs(len(moved) / len(KEYS) - 1 / n) <= TOLERANCE / n
    # Its keys spread over the others, not onto one neighbour.
    heirs = [after[i] for i in moved]
    assert all(heirs.count(a) > len(moved) / (n - 1) / 2 for a in nodes if a != gone)


def test_client_shards_with_the_ring_and_follows_membership():
    client = CacheClient(["b:2", "a:1", "a:1"])
    assert client.addresses == ["a:1", "b:2"]
    ring = HashRing(["a:1", "b:2"])
    assert all(client.shard(k) == ring.node(k) for k in KEYS[:1000])
    client.set_addresses(["a:1"])
    assert {client.shard(k) for k in KEYS[:1000]} == {"a:1"}
    assert HashRing(["x"]).node(KEYS[0]) == "x"
    with pytest.raises(ValueError):
        HashRing(["x"], vnodes=0)
