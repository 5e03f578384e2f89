"""Where a prompt's leading KV blocks are, per worker: what a route asks of the prefix
index (services/master/prefix_index.py), once per Route call, and only of the workers that
hold the prompt's first block; every other worker matches 0 blocks in both its tiers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rtp_serve.services.common.pb import nameservice_pb2
from rtp_serve.services.master.cluster import ClusterView
from rtp_serve.services.master.prefix_index import PrefixIndex


def _first_block_holders(index: PrefixIndex, hashes: Sequence[bytes]) -> dict[str, int]:
    """`index.match_all` of every worker that holds `hashes[0]` (the others match 0)."""
    return index.match_holders(hashes) if hashes else {}


@dataclass(frozen=True, slots=True)
class Prefix:
    """Where the prompt's leading blocks are: per worker with any, its match in its pool
    (T0) and its host tier's match after that (T1); every other worker matches 0 in both.
    `reachable`: the longest prefix the remote tier can give (see cost.py)."""

    device: dict[str, int]
    host: dict[str, int]
    reachable: int

    @classmethod
    def of(cls, view: ClusterView, hashes: Sequence[bytes]) -> Prefix:
        index = view.index
        device = _first_block_holders(index, hashes)
        host = {}
        if index.host is not None and len(index.host):
            host = _first_block_holders(index.host, hashes)
            host |= {w: index.host.match(w, hashes, n) for w, n in device.items()}
            host = {w: n for w, n in host.items() if n}
        # What the remote tier can give: what its instances hold (T2 and T3), and what any
        # worker holds (each wrote it back).
        caches = [m.id for m in view.members(nameservice_pb2.ROLE_CACHE)]
        held = (device.get(w, 0) + host.get(w, 0) for w in device.keys() | host.keys()
                if w not in caches)  # fmt: skip
        reachable = max(held, default=0)
        if caches:
            reachable = max(reachable, index.match_any(hashes, caches))
        return cls(device, host, reachable)
