"""A KV block's size without serializing it.

Protobuf's `ByteSize()` (the upb runtime) serializes the message to measure it: for a block
of 1.2 MB that cost 2.5 ms, as much as sending it, and the cache client's batching and the PD
transfer metrics called it on every block. A block's size is almost all its payload, whose
lengths are known.
"""

from __future__ import annotations

from rtp_serve.services.common.pb import common_pb2

# Everything in a KVBlock but its payload (key, index, counts, dtype, shape, integrity tag,
# field tags and lengths) takes under this many bytes: a 32-byte key and tag, a 4-d shape
# and their framing come to about 100.
HEADER_BOUND = 256


def payload_nbytes(block: common_pb2.KVBlock) -> int:
    """The bytes of K, V and their scales."""
    return len(block.k) + len(block.v) + len(block.k_scale) + len(block.v_scale)


def wire_nbytes_bound(block: common_pb2.KVBlock) -> int:
    """An upper bound on the block's serialized size."""
    return payload_nbytes(block) + HEADER_BOUND
