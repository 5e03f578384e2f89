"""A prompt's block hashes as one buffer (RouteRequest.packed_block_hashes).

`repeated bytes block_hashes` makes a Python bytes object for every hash each time a field
is read: a trace prompt has ~800 of them, and checking their lengths alone took 13% of a
batched route's time in the master (docs/operations/scale.md, "Batched routes"). Packed,
the whole prompt is one bytes object whose length says at once whether every hash is 16
bytes, and the prefix index reads its slices as they are (`prefix_index.packed`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

from rtp_serve.services.common.pb import master_pb2

BLOCK_HASH_BYTES = 16


class PackedHashes(Sequence[bytes]):
    """Block hashes, 16 bytes each, back to back: a Sequence[bytes] whose slices are
    PackedHashes (one copy of their bytes) and whose items are made only when read."""

    __slots__ = ("packed",)

    def __init__(self, packed: bytes) -> None:
        if len(packed) % BLOCK_HASH_BYTES:
            raise ValueError(
                f"packed block hashes are {len(packed)} bytes, not a multiple of {BLOCK_HASH_BYTES}"
            )
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed) // BLOCK_HASH_BYTES

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> PackedHashes: ...
    def __getitem__(self, i: int | slice) -> bytes | PackedHashes:
        n = len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                raise ValueError("packed block hashes slice with step 1 only")
            return PackedHashes(self.packed[start * BLOCK_HASH_BYTES : stop * BLOCK_HASH_BYTES])
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("block hash index out of range")
        return self.packed[i * BLOCK_HASH_BYTES : (i + 1) * BLOCK_HASH_BYTES]

    def __iter__(self) -> Iterator[bytes]:
        packed = self.packed
        return (packed[i : i + BLOCK_HASH_BYTES] for i in range(0, len(packed), BLOCK_HASH_BYTES))


def route_hashes(request: master_pb2.RouteRequest) -> Sequence[bytes]:
    """The request's block hashes, from whichever field it sent them in."""
    if request.packed_block_hashes:
        return PackedHashes(request.packed_block_hashes)
    return request.block_hashes
