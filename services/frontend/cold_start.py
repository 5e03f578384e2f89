"""Requests that arrive while no worker runs (scaled to zero, or all restarting) wait here.

With --hold-for-workers-s > 0 a request that finds no routable worker is held until one
registers (the planner starts one when it sees rtp:requests_waiting_for_workers above 0),
for at most that long and never past its own deadline; at most --max-waiting-for-workers
are held at once, and the next is refused at once (503), as is one whose wait ran out.
Without it (0, the default) such a request is refused at once, as before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import Gauge

from rtp_serve.services.frontend.errors import ErrorKind, FrontendError

POLL_S = 0.05  # how often a held request looks at the membership again


class WorkerWait:
    def __init__(
        self, routable: Callable[[], bool], hold_s: float, max_waiting: int, gauge: Gauge
    ) -> None:
        """`routable`: whether a worker can take a request now (the membership's view)."""
        if hold_s < 0 or max_waiting < 0:
            raise ValueError("hold_s and max_waiting must be >= 0")
        self._routable = routable
        self.hold_s = hold_s
        self.max_waiting = max_waiting
        self.waiting = 0
        self._gauge = gauge

    async def until_routable(self, remaining: float | None) -> None:
        """Return once a worker can be routed to; raises FrontendError (UNAVAILABLE) when
        holding is off, full, or ran out of time. `remaining`: what is left of the request's
        deadline (None: none)."""
        if self._routable() or self.hold_s <= 0:
            return
        if self.waiting >= self.max_waiting:
            raise FrontendError(
                ErrorKind.UNAVAILABLE,
                f"no worker is running, and {self.waiting} requests already wait for one to "
                "start (--max-waiting-for-workers)",
                code="service_unavailable",
            )
        budget = self.hold_s if remaining is None else min(self.hold_s, remaining)
        deadline = time.monotonic() + budget
        self.waiting += 1
        self._gauge.inc()
        try:
            while not self._routable():
                if time.monotonic() >= deadline:
                    raise FrontendError(
                        ErrorKind.UNAVAILABLE,
                        f"no worker started within {budget:.1f} s",
                        code="service_unavailable",
                    )
                await asyncio.sleep(POLL_S)
        finally:
            self.waiting -= 1
            self._gauge.dec()
