"""Chained prefix block hash keys and the cache salt: the one implementation of both.

key_i = H(key_{i-1} || tokens of block i || salt), so equal keys mean equal prefixes, not
just equal blocks. The salt covers everything that changes the KV for the same tokens
(model, KV dtype, adapter); `cache_salt` is the only place it is made, and the engine, the
frontend, the master and the tests all call it. Only full blocks get keys: a partial tail
block is never shared.

This module must stay importable without torch: the frontend and master use it.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from collections.abc import Sequence
from pathlib import Path

BlockHash = bytes  # 16-byte BLAKE2b digest

_DIGEST_SIZE = 16
# Weight bytes sampled per checkpoint file for the fingerprint: enough to tell a fine-tune
# from its base (training moves essentially every weight), cheap for a 100 GB checkpoint.
_SAMPLES_PER_FILE = 64
_SAMPLE_BYTES = 4096


def model_fingerprint(model_dir: str | os.PathLike) -> bytes:
    """Identify a checkpoint by content, not by where it is mounted.

    Hashes config.json (canonical JSON) and, for every safetensors file, its name, its tensor
    index (the header: names, dtypes, shapes, offsets) and a fixed sample of its weight
    bytes. The same checkpoint at two paths (a container and a laptop) gets the same value.
    """
    path = Path(model_dir)
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    config = json.loads((path / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for file in sorted(path.glob("*.safetensors")):
        h.update(b"\0" + file.name.encode() + b"\0")
        _hash_safetensors(file, h)
    return h.digest()


def adapter_fingerprint(adapter_dir: str | os.PathLike) -> bytes:
    """Identify a LoRA adapter (PEFT layout) by content, as `model_fingerprint` a checkpoint:
    the same adapter under two names or paths shares KV; a different one under a reused
    name never does."""
    path = Path(adapter_dir)
    h = hashlib.blake2b(b"lora", digest_size=_DIGEST_SIZE)
    config = json.loads((path / "adapter_config.json").read_text())
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    _hash_safetensors(path / "adapter_model.safetensors", h)
    return h.digest()


def _hash_safetensors(file: Path, h: hashlib.blake2b) -> None:
    # Layout: 8-byte little-endian header length, JSON header, then the tensor data.
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        h.update(f.read(header_len))
        data_start = 8 + header_len
        data_len = os.fstat(f.fileno()).st_size - data_start
        step = max(data_len // _SAMPLES_PER_FILE, 1)
        offsets = [*range(0, data_len, step)[:_SAMPLES_PER_FILE], max(data_len - _SAMPLE_BYTES, 0)]
        for offset in offsets:  # evenly spread, and the tail
            h.update(os.pread(f.fileno(), _SAMPLE_BYTES, data_start + offset))


def cache_salt(model_dir: str | os.PathLike, kv_dtype: str, adapter: str = "") -> bytes:
    """The salt of a cache namespace: blocks from different namespaces never match.

    `adapter` is a LoRA adapter's `adapter_fingerprint` in hex (empty for the base model); `kv_dtype` is what fixes
    a block's values besides its tokens: `rtp_serve.core.dtypes.kv_numerics(dtype, weight_dtype,
    kv_dtype)`, the dtype's name alone when weights and KV are stored in the model dtype.
    """
    return salt_of(model_fingerprint(model_dir).hex(), kv_dtype, adapter)


def salt_of(model_id: str, kv_dtype: str, adapter: str = "") -> bytes:
    """`cache_salt` for a model already identified by `model_id` (tests, fingerprints)."""
    return hashlib.blake2b(
        f"{model_id}\0{kv_dtype}\0{adapter}".encode(), digest_size=_DIGEST_SIZE
    ).digest()


def hash_block(parent: BlockHash | None, tokens: Sequence[int], salt: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(parent or b"\0" * _DIGEST_SIZE)
    h.update(array("q", tokens).tobytes())
    h.update(salt)
    return h.digest()


def block_hash_keys(
    token_ids: Sequence[int],
    block_size: int,
    salt: bytes = b"",
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
        parent = hash_block(parent, token_ids[begin : begin + block_size], salt)
        keys.append(parent)
    return keys


def verify_first_key(
    keys: Sequence[BlockHash], token_ids: Sequence[int], block_size: int, salt: bytes
) -> bool:
    """Cheap check of keys computed by a peer: right count, and the first key (which covers
    the salt) equals ours. A peer with another model or KV dtype fails it."""
    if len(keys) != len(token_ids) // block_size:
        return False
    return not keys or keys[0] == hash_block(None, token_ids[:block_size], salt)
