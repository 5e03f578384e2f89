"""Events held back until a cut passes their stamps (the master's --event-cutoff-ms).

Two master replicas receive every NATS event a few milliseconds apart, and route each
request at a slightly different moment; a choice over a thousand workers' loads changes
with every report, so two replicas asked the same would choose alike only by luck. With a
cutoff, each event (a load report, a KV batch, a route charge) counts only once the view's
cut passes its stamp, and a route moves the cut to its request's stamp less the cutoff: two
replicas that received every event stamped before the cut count exactly those, in stamp
order, whatever order and moment they arrived in (`ClusterView.catch_up`).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterator
from typing import Any


class Kind(enum.IntEnum):
    """What a held event is; equal stamps count in this order (the same on every replica)."""

    KV = 0
    LOAD = 1
    CHARGE = 2


class HeldEvents:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._arrival = itertools.count()  # keeps equal (stamp, kind) in arrival order

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, stamp_s: float, kind: Kind, event: Any) -> None:
        heapq.heappush(self._heap, (stamp_s, kind, next(self._arrival), event))

    def due(self, cut_s: float) -> Iterator[tuple[float, Kind, Any]]:
        """Remove and yield (stamp, kind, event) of every event stamped at or before
        `cut_s`, oldest first."""
        heap = self._heap
        while heap and heap[0][0] <= cut_s:
            stamp, kind, _, event = heapq.heappop(heap)
            yield stamp, Kind(kind), event
