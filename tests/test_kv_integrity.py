"""Integrity tags of KV blocks in the cache tiers (services/cache/integrity.py), exactly:
which changes a tag catches, keyed and not, and which prefix of a fetched list is usable."""

from __future__ import annotations

import torch

from rtp_serve.engine.outputs import PromptKV
from rtp_serve.services.cache.integrity import KVIntegrity
from rtp_serve.services.common.pb import common_pb2
from rtp_serve.services.worker.kv_wire import split_blocks

KEYS = [bytes([i]) * 16 for i in range(3)]


def _blocks(seed: int = 0) -> list[common_pb2.KVBlock]:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 48, 2, 4, generator=g), torch.randn(2, 48, 2, 4, generator=g)
    return split_blocks(PromptKV(0, k, v), 16, KEYS)


def _sealed(integrity: KVIntegrity) -> list[common_pb2.KVBlock]:
    blocks = _blocks()
    for b in blocks:
        integrity.seal(b)
    return blocks


def test_a_sealed_block_verifies_under_its_own_key_only():
    for integrity in (KVIntegrity(), KVIntegrity(b"cluster secret")):
        blocks = _sealed(integrity)
        assert [integrity.verify(k, b) for k, b in zip(KEYS, blocks, strict=True)] == [True] * 3
        assert not integrity.verify(KEYS[1], blocks[0])  # stored under another block's key
        unsealed = _blocks()[0]
        assert not integrity.verify(KEYS[0], unsealed)  # no tag at all


def test_every_payload_field_is_covered():
    integrity = KVIntegrity()
    for field in ("k", "v", "dtype", "shape", "index", "num_tokens"):
        block = _sealed(integrity)[0]
        if field in ("k", "v"):
            data = bytearray(getattr(block, field))
            data[5] ^= 0x01  # one flipped bit
            setattr(block, field, bytes(data))
        elif field == "dtype":
            block.dtype = "bfloat16"
        elif field == "shape":
            block.shape[1] = 15
        else:
            setattr(block, field, getattr(block, field) + 1)
        assert not integrity.verify(KEYS[0], block), field


def test_only_the_secret_holder_can_forge_a_keyed_tag():
    keyed = KVIntegrity(b"cluster secret")
    forged = _blocks(seed=1)[0]  # other KV, tagged by someone without the secret
    KVIntegrity().seal(forged)
    assert not keyed.verify(KEYS[0], forged)
    KVIntegrity(b"a guess").seal(forged)
    assert not keyed.verify(KEYS[0], forged)
    keyed.seal(forged)
    assert keyed.verify(KEYS[0], forged)


def test_valid_prefix_stops_at_the_first_bad_block_and_counts_all():
    integrity = KVIntegrity(b"s")
    blocks = _sealed(integrity)
    assert integrity.valid_prefix(KEYS, blocks) == (blocks, 0)
    blocks[1].k = bytes(len(blocks[1].k))
    assert integrity.valid_prefix(KEYS, blocks) == (blocks[:1], 1)
    blocks[0].integrity = b""
    assert integrity.valid_prefix(KEYS, blocks) == ([], 2)
