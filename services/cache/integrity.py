"""Integrity tags on KV blocks stored in the cache tiers (cache service, Redis).

The tiers are storage a worker does not trust: anything that can write to them (a bug, a
bit flip, a stale instance, an attacker) could hand a worker KV that does not belong to the
prompt, and the model would silently continue from it. So the worker that writes a block
seals it, and the worker that reads it back checks the seal against the key it asked for:

    tag = HMAC-SHA256(secret, msg)   with --kv-integrity-key (a secret every worker shares)
          SHA-256(msg)               without one
    msg = "rtp-kv/1" | key | index | num_tokens | dtype | shape | k | v | k_scale | v_scale
          (every field length-prefixed, so no two blocks encode alike)

Both catch corruption and a block stored under another block's key; only the keyed HMAC
also stops someone who can write to the tiers but has no key from forging a block. A block
whose tag does not match is dropped (its tokens are recomputed) and counted.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable

from rtp_serve.services.common.pb import common_pb2

_DOMAIN = b"rtp-kv/1"


class KVIntegrity:
    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or None

    @property
    def keyed(self) -> bool:
        return self._secret is not None

    def tag(self, key: bytes, block: common_pb2.KVBlock) -> bytes:
        """The tag of `block` stored under `key`."""
        h = hmac.new(self._secret, digestmod=hashlib.sha256) if self._secret else hashlib.sha256()
        parts: Iterable[bytes] = (
            _DOMAIN,
            key,
            struct.pack("<II", block.index, block.num_tokens),
            block.dtype.encode(),
            struct.pack(f"<{len(block.shape)}I", *block.shape),
            block.k,
            block.v,
            block.k_scale,
            block.v_scale,
        )
        for part in parts:
            h.update(struct.pack("<Q", len(part)))
            h.update(part)
        return h.digest()

    def seal(self, block: common_pb2.KVBlock) -> None:
        """Set `block.integrity` for storing it under its own block_hash."""
        block.integrity = self.tag(block.block_hash, block)

    def verify(self, key: bytes, block: common_pb2.KVBlock) -> bool:
        """Does `block` carry the tag of a block stored under `key`? (constant time)"""
        return bool(block.integrity) and hmac.compare_digest(block.integrity, self.tag(key, block))

    def valid_prefix(
        self, keys: list[bytes], blocks: list[common_pb2.KVBlock]
    ) -> tuple[list[common_pb2.KVBlock], int]:
        """The leading blocks that verify against `keys` (in order), and how many of all
        `blocks` did not verify."""
        ok = [self.verify(key, block) for key, block in zip(keys, blocks, strict=False)]
        first_bad = ok.index(False) if False in ok else len(ok)
        return blocks[:first_bad], ok.count(False)
