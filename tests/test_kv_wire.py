"""KV blocks on the wire (services/worker/kv_wire.py): what a cache stores crosses exactly,
an int8 block with its scales, and what does not fit the receiver is refused."""

from __future__ import annotations

import pytest
import torch

from rtp_serve.engine.config import KVLayout
from rtp_serve.engine.outputs import PromptKV
from rtp_serve.services.worker.kv_wire import join_blocks, split_blocks

LAYERS, HEADS, DIM, BS = 2, 3, 8, 4


def _kv(dtype: str, start: int, n: int) -> PromptKV:
    torch.manual_seed(0)
    shape = (LAYERS, n, HEADS, DIM)
    blocks = -(-n // BS)
    if dtype == "int8":
        k, v = (torch.randint(-127, 128, shape, dtype=torch.int8) for _ in range(2))
        return PromptKV(
            start, k, v, torch.rand(LAYERS, blocks, HEADS), torch.rand(LAYERS, blocks, HEADS)
        )
    return PromptKV(
        start,
        torch.randn(shape).to(getattr(torch, dtype)),
        torch.randn(shape).to(getattr(torch, dtype)),
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_blocks_round_trip_exactly(dtype):
    kv = _kv(dtype, start=8, n=10)  # blocks 2, 3 and a partial block 4
    hashes = [bytes([i]) * 8 for i in range(4)]
    blocks = split_blocks(kv, BS, hashes)
    assert [b.index for b in blocks] == [2, 3, 4] and blocks[-1].num_tokens == 2
    assert [b.block_hash for b in blocks] == [hashes[2], hashes[3], b""]
    layout = KVLayout(LAYERS, HEADS, DIM, dtype)
    back = join_blocks(list(reversed(blocks)), 8, 18, BS, hashes, layout)
    assert back.start == 8
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(kv, name), getattr(back, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name


def test_an_int8_block_without_scales_or_of_another_dtype_is_refused():
    kv = _kv("int8", start=0, n=8)
    hashes = [b"a" * 8, b"b" * 8]
    layout = KVLayout(LAYERS, HEADS, DIM, "int8")
    blocks = split_blocks(kv, BS, hashes)
    blocks[1].ClearField("v_scale")
    with pytest.raises(ValueError, match="elements"):
        join_blocks(blocks, 0, 8, BS, hashes, layout)
    with pytest.raises(ValueError, match="expected bfloat16"):
        join_blocks(
            split_blocks(kv, BS, hashes), 0, 8, BS, hashes, KVLayout(LAYERS, HEADS, DIM, "bfloat16")
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_blocks_size_bound_holds_without_serializing_it(dtype):
    """The cache client batches and the PD metrics count by payload length (ByteSize()
    serializes the block): the bound is above the real size, sealed, with a 32-byte key."""
    from rtp_serve.services.cache.integrity import KVIntegrity
    from rtp_serve.services.common.kv_block_size import payload_nbytes, wire_nbytes_bound

    blocks = split_blocks(_kv(dtype, start=0, n=10), BS, [bytes([i]) * 32 for i in range(2)])
    for block in blocks:
        KVIntegrity(b"secret").seal(block)
        assert payload_nbytes(block) < block.ByteSize() <= wire_nbytes_bound(block)
