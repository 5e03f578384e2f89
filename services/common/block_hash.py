"""Chained prefix block hash keys: the one implementation every service uses.

key_i = H(key_{i-1} || tokens of block i || extra), so equal keys mean equal prefixes, not
just equal blocks. `extra` covers everything that changes the KV for the same tokens (model,
adapter, KV dtype). Only full blocks get keys: a partial tail block is never shared.

This module must stay importable without torch: the frontend and master use it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes  # 16-byte BLAKE2b digest

_DIGEST_SIZE = 16


def hash_extra(model: str, kv_dtype: str, adapter: str = "") -> bytes:
    """The `extra` salt of a cache namespace: blocks from different ones never match."""
    return hashlib.blake2b(
        f"{model}\0{kv_dtype}\0{adapter}".encode(), digest_size=_DIGEST_SIZE
    ).digest()


def hash_block(parent: BlockHash | None, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(parent or b"\0" * _DIGEST_SIZE)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def block_hash_keys(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    parent: BlockHash | None = None,
    start: int = 0,
) -> list[BlockHash]:
    """Keys of the full blocks of `token_ids[start:]`, chained from `parent`.

    `start` must be a multiple of `block_size`; it lets a caller extend the keys it already
    has as a sequence grows without rehashing the prefix.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start % block_size:
        raise ValueError(f"start ({start}) must be a multiple of block_size ({block_size})")
    keys: list[BlockHash] = []
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size], extra)
        keys.append(parent)
    return keys
