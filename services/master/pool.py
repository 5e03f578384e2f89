"""A route's candidate workers as columns: their slots in the view's LoadTable
(services/master/load_table.py), in member-id order so choices are deterministic, their
loads read once, and the filters every policy applies to them."""

from __future__ import annotations

import numpy as np

from rtp_serve.services.master.cluster import ClusterView, Member
from rtp_serve.services.master.load_table import Loads


class Pool:
    """Candidate workers: their slots in the view's LoadTable, in member-id order, and
    their loads (read from the table once, at first use: make a new pool after a charge)."""

    __slots__ = ("view", "slots", "_loads")

    def __init__(self, view: ClusterView, slots: np.ndarray, loads: Loads | None = None) -> None:
        self.view, self.slots, self._loads = view, slots, loads

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def loads(self) -> Loads:
        if self._loads is None:
            view = self.view
            self._loads = view.table.gather(self.slots, view.now(), view.load_ttl_s)
        return self._loads

    def member(self, i: int) -> Member:
        return self.view.table.member(int(self.slots[i]))

    def pick(self, key: str, among: np.ndarray) -> int:
        """The index in `among` (positions here) of the worker that wins `key`'s rendezvous:
        ties break the same way on every master replica (services/common/rendezvous.py)."""
        return self.view.table.pick(key, self.slots[among])

    def take(self, which: np.ndarray) -> Pool:
        loads = self._loads.take(which) if self._loads is not None else None
        return Pool(self.view, self.slots[which], loads)

    def column(self, values: dict[str, int]) -> np.ndarray | None:
        """`values` (worker id -> n) at the candidates' positions, 0 for the rest; None
        where that is 0 everywhere."""
        if not values:
            return None
        table = self.view.table
        at = np.zeros(table.capacity, dtype=np.int64)
        for worker_id, n in values.items():
            if (slot := table.slot(worker_id)) is not None:
                at[slot] = n
        out = at[self.slots]
        return out if out.any() else None


def lora_mask(pool: Pool, loads: Loads, lora: str, resident: bool) -> np.ndarray:
    """Which candidates' fresh reports list `lora` (among the resident ones: `resident`)."""
    table = pool.view.table
    sets = table.resident_loras if resident else table.loras
    listed = np.array([lora in sets[s] for s in pool.slots.tolist()], dtype=bool)
    return loads.fresh & listed


def serving(pool: Pool, lora: str) -> Pool:
    """The members whose load report lists `lora` among the adapters they serve; all of
    them when none does (reports not in yet: the worker itself answers NOT_FOUND)."""
    if not lora or not len(pool):
        return pool
    have = lora_mask(pool, pool.loads, lora, resident=False)
    return pool.take(have) if have.any() else pool


def with_room(pool: Pool) -> Pool:
    """The members whose waiting queue is below its bound (as last reported); all of them
    when none has room (the chosen one then refuses the request: 429, retry later)."""
    loads = pool.loads
    full = loads.fresh & (loads.max_waiting > 0) & (loads.max_waiting <= loads.waiting)
    return pool.take(~full) if full.any() and not full.all() else pool


def reporting(pool: Pool) -> Pool:
    """The members with a fresh load report; all of them when none has one (no NATS, or
    all just started: then costs count only what was routed here)."""
    fresh = pool.loads.fresh
    return pool.take(fresh) if fresh.any() and not fresh.all() else pool
