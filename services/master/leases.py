"""Request ids in flight across the cluster's frontends: the master's leases on them.

A client that retries a request (same `X-Request-Id`) through another frontend while the
first attempt still runs must not have it generated twice, on two workers at once. Each
frontend routes through the master with its member id; the master leases the request id
to that frontend until the frontend releases it (the request ended), the lease expires, or
the frontend leaves the cluster (its calls to the workers died with it). Meanwhile another
frontend asking for the same id is refused; the same frontend asking again (a migration
after a worker failed) renews its lease.

Each master replica holds its own leases: with several replicas, a retry that a different
replica routes is not seen (the frontends' own check, services/frontend Admission, still
holds per frontend). While the master is down, frontends route without it, and without
leases.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

LEASE_TTL_S = 600.0  # longer than any request should run; a lost release expires here
MAX_LEASES = 1 << 16  # beyond it, the oldest go first (they are the likeliest stale)


@dataclass(slots=True)
class _Lease:
    frontend_id: str
    expires: float


class RequestLeases:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = LEASE_TTL_S,
        max_leases: int = MAX_LEASES,
    ) -> None:
        self._clock = clock
        self.ttl_s = ttl_s
        self.max_leases = max_leases
        self._leases: OrderedDict[str, _Lease] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._leases)

    def acquire(
        self, request_id: str, frontend_id: str, gone: Callable[[str], bool] = lambda _: False
    ) -> str | None:
        """Lease `request_id` to `frontend_id`: None if granted (free, renewed, or taken over
        from an expired lease or a frontend that is `gone`), else the frontend holding it."""
        now = self._clock()
        held = self._leases.get(request_id)
        live = held is not None and held.expires > now and not gone(held.frontend_id)
        if live and held.frontend_id != frontend_id:
            return held.frontend_id
        self._leases[request_id] = _Lease(frontend_id, now + self.ttl_s)
        self._leases.move_to_end(request_id)
        while len(self._leases) > self.max_leases:
            self._leases.popitem(last=False)
        return None

    def release(self, request_id: str, frontend_id: str) -> bool:
        """End `frontend_id`'s lease on `request_id` (False: it holds none)."""
        held = self._leases.get(request_id)
        if held is None or held.frontend_id != frontend_id:
            return False
        del self._leases[request_id]
        return True
