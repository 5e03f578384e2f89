"""The waiting queue, shared between tenants by weighted tokens served (VTC).

The Virtual Token Counter ("Fairness in Serving Large Language Models", OSDI 2024): each
tenant has a counter of the tokens computed for it, divided by its weight. Within a priority
class the tenant with the smallest counter is admitted next, and the running request
preempted first is the most-served tenant's newest. Priority classes come first: a more
urgent class always goes before a less urgent one, whoever has been served.

    waiting:  (priority, tenant) -> heap of requests by arrival
    next:     min over non-empty queues of (priority, served[tenant], head's arrival)
    victim:   max over running of (priority, served[tenant], arrival)
    displace: the head cannot start (no slot, or no blocks): it takes the place of another
              tenant's running request in its class, when that tenant has been served at
              least as much and, even without the request, keeps at least the weighted
              share of the class's slots that the head's tenant will have with the head:
                  (running[v] - 1) / weight[v]  >=  (running[h] + 1) / weight[h]
              The next arrival cannot undo the swap (the inequality reverses), so slots
              settle at the weighted shares instead of changing hands every step.

A tenant that becomes active (its first request arrives while it has none here) has its
counter lifted to the least-served active tenant's, so idling banks no credit; with nobody
else active it is lifted to the highest counter, which changes no order. The queue only
orders: whatever waits is admitted when there is room (work-conserving), and one tenant
alone gets the whole worker.

The counters of tenants with nothing here are kept for the `max_idle` most recently active
(LRU), so a worker that sees many tenant names holds a bounded number; a forgotten tenant
coming back is lifted like a newcomer.

With `fair` off, or with one tenant, the order is (priority, arrival), as before tenants.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator

from rtp_serve.engine.request import Request, RequestStatus

MAX_IDLE_TENANTS = 1024


class FairQueue:
    def __init__(self, fair: bool = True, max_idle: int = MAX_IDLE_TENANTS) -> None:
        self.fair = fair
        self.max_idle = max_idle
        self.served: dict[str, float] = {}  # tenant -> weighted tokens computed for it
        self._active: Counter[str] = Counter()  # tenant -> its requests waiting or running
        self._idle: OrderedDict[str, None] = OrderedDict()  # counters kept, oldest first
        self._high = 0.0  # the highest counter ever (forgotten tenants' included)
        self._queues: dict[tuple[int, str], list[tuple[int, Request]]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for heap in self._queues.values():
            for _, request in heap:
                yield request

    # -- tenants ---------------------------------------------------------------------------
    def arrive(self, request: Request) -> None:
        """A request joins the scheduler (queued or held)."""
        tenant = request.tenant.name
        if not self._active[tenant]:
            others = [self.served[t] for t in self._active if t != tenant]
            floor = min(others) if others else self._high
            self.served[tenant] = max(self.served.get(tenant, 0.0), floor)
            self._idle.pop(tenant, None)
        self._active[tenant] += 1

    def leave(self, request: Request) -> None:
        """A request leaves the scheduler (finished or aborted)."""
        tenant = request.tenant.name
        self._active[tenant] -= 1
        if self._active[tenant] <= 0:
            del self._active[tenant]
            self._idle[tenant] = None
            while len(self._idle) > self.max_idle:
                forgotten, _ = self._idle.popitem(last=False)
                del self.served[forgotten]

    def charge(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` were computed for `request` (prompt or output alike)."""
        tenant = request.tenant
        served = self.served.get(tenant.name, 0.0) + num_tokens / tenant.weight
        self.served[tenant.name] = served
        self._high = max(self._high, served)

    def _service(self, request: Request) -> float:
        return self.served.get(request.tenant.name, 0.0) if self.fair else 0.0

    def victim(self, running: Iterable[Request]) -> Request:
        """The running request to preempt first: least urgent class, most served, newest."""
        return max(
            (r for r in running if r.status == RequestStatus.RUNNING),
            key=lambda r: (r.priority, self._service(r), r.arrival),
        )

    def displaced_by(self, head: Request, running: Iterable[Request]) -> Request | None:
        """The running request `head` may take the place of, when it cannot start (module
        docstring); None: it waits. The most-served such tenant's newest request."""
        if not self.fair:
            return None
        mine = head.tenant
        peers = [
            r for r in running if r.status == RequestStatus.RUNNING and r.priority == head.priority
        ]
        slots = Counter(r.tenant.name for r in peers)
        share = (slots[mine.name] + 1) / mine.weight  # the head's tenant's, with the head
        served = self.served.get(mine.name, 0.0)

        def over_served(r: Request) -> bool:
            t = r.tenant
            return (
                t.name != mine.name
                and self.served[t.name] >= served
                and (slots[t.name] - 1) / t.weight >= share
            )

        return max(
            filter(over_served, peers),
            key=lambda r: (self.served[r.tenant.name], r.arrival),
            default=None,
        )

    # -- the queue -------------------------------------------------------------------------
    def push(self, request: Request) -> None:
        key = (request.priority, request.tenant.name if self.fair else "")
        heapq.heappush(self._queues.setdefault(key, []), (request.arrival, request))
        self._len += 1

    def _head_key(self) -> tuple[int, str] | None:
        best, best_key = None, None
        for key, heap in self._queues.items():
            request = heap[0][1]
            rank = (request.priority, self._service(request), request.arrival)
            if best is None or rank < best:
                best, best_key = rank, key
        return best_key

    def peek(self) -> Request:
        """The request to admit next (IndexError when empty)."""
        key = self._head_key()
        if key is None:
            raise IndexError("peek at an empty queue")
        return self._queues[key][0][1]

    def pop(self) -> Request:
        key = self._head_key()
        if key is None:
            raise IndexError("pop from an empty queue")
        heap = self._queues[key]
        _, request = heapq.heappop(heap)
        if not heap:
            del self._queues[key]
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        key = (request.priority, request.tenant.name if self.fair else "")
        heap = [(a, r) for a, r in self._queues.get(key, []) if r is not request]
        if len(heap) == len(self._queues.get(key, [])):
            raise ValueError(f"request {request.request_id!r} is not queued")
        self._len -= 1
        if heap:
            heapq.heapify(heap)
            self._queues[key] = heap
        else:
            del self._queues[key]
