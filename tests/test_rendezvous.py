"""Rendezvous hashing (services/common/rendezvous.py): the numpy weights equal the scalar
ones bit for bit, and taking items away moves only the keys they won."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from rtp_serve.services.common import rendezvous

names = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=40, unique=True)


@given(st.text(max_size=20), names)
def test_vector_weights_equal_the_scalar_ones(key, items):
    k = rendezvous.hash64(key)
    hashes = np.array([rendezvous.hash64(n) for n in items], dtype=np.uint64)
    assert rendezvous.weights(k, hashes).tolist() == [rendezvous.weight(k, int(h)) for h in hashes]
    assert items[rendezvous.pick(key, hashes)] == rendezvous.order(key, items)[0]


def test_removing_an_item_moves_only_its_keys():
    items = [f"fused-{i}" for i in range(100)]
    keys = [f"req-{i}" for i in range(2000)]
    before = {k: rendezvous.order(k, items)[0] for k in keys}
    after = {k: rendezvous.order(k, items[:-3])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] in items[-3:]}
    assert 0 < len(moved) < 0.1 * len(keys)  # about 3% of them
    assert len(set(before.values())) > 90  # spread over the items
