"""Every member's latest load as columns, so a route prices all its candidates with a few
numpy expressions instead of a Python loop over them (services/master/cost.py).

ClusterView owns one and keeps it equal to its own maps: a slot per member, filled from
the member's LoadReport when one arrives, and its pending charges (what was routed there
since) summed as they are made and expire. The report fields stay raw; `gather` reads the
rows of a route's candidates at once and applies the view's rules (a report older than
the load TTL is no report: zeros, the default block size).

    floats  [column, slot]   arrival, step fit, fetch fits (host, remote, transfer)
    ints    [column, slot]   queue, batch, blocks, ..., pending requests / tokens / blocks
    order   role -> slots    the role's members sorted by id (rebuilt after a change)
"""

from __future__ import annotations

import math

import numpy as np

from rtp_serve.core.cost_model import TIER_HOST, TIER_REMOTE, TIER_TRANSFER
from rtp_serve.services.common import rendezvous
from rtp_serve.services.common.pb import events_pb2, nameservice_pb2

DEFAULT_BLOCK_SIZE = 16  # used until a worker's LoadReport says otherwise

# The report's fields, and what follows from them alone (computed once, as it arrives):
#   step_run   StepCost.step_s(0, running): a step of its running batch
#   in_flight  step_run if it runs anything (the step a new request waits for), else 0
#   fitted     its step model is fitted (StepCost.fitted); host_fitted, transfer_fitted: the
#              FetchCost of that tier is; remote_fetch: it reads the remote tier, and that
#              fetch is fitted
FLOATS = ("arrival", "step_fixed", "step_token", "step_row", "step_run", "in_flight",
          "host_fixed", "host_byte", "remote_fixed", "remote_byte", "transfer_fixed",
          "transfer_byte")  # fmt: skip
INTS = ("queued", "running", "waiting", "max_waiting", "free", "block_size", "kv_block_bytes",
        "budget", "fitted", "host_fitted", "remote_fetch", "transfer_fitted", "max_seqs",
        "pending_requests", "pending_tokens", "pending_blocks", "host")  # fmt: skip
_F = {name: i for i, name in enumerate(FLOATS)}
_I = {name: i for i, name in enumerate(INTS)}
_REPORT_INTS = INTS[: INTS.index("pending_requests")]
_PENDING = slice(_I["pending_requests"], _I["pending_blocks"] + 1)
_TIERS = (TIER_HOST, TIER_REMOTE, TIER_TRANSFER)


class Loads:
    """Columns of some candidates (in the order asked), as the view sees them now: where
    `fresh` is False every report field is 0 and the block size the default. One attribute
    per name in FLOATS and INTS (a row of `floats` or `ints`)."""

    __slots__ = ("floats", "ints", "fresh")

    def __init__(self, floats: np.ndarray, ints: np.ndarray, fresh: np.ndarray) -> None:
        self.floats, self.ints, self.fresh = floats, ints, fresh

    def __len__(self) -> int:
        return len(self.fresh)

    def take(self, which: np.ndarray) -> Loads:
        return Loads(self.floats[:, which], self.ints[:, which], self.fresh[which])


for _name, _i in _F.items():
    setattr(Loads, _name, property(lambda self, i=_i: self.floats[i]))
for _name, _i in _I.items():
    setattr(Loads, _name, property(lambda self, i=_i: self.ints[i]))


class LoadTable:
    def __init__(self, capacity: int = 64) -> None:
        self._floats = np.zeros((len(FLOATS), capacity))
        self._ints = np.zeros((len(INTS), capacity), dtype=np.int64)
        self._floats[_F["arrival"]] = -math.inf
        self._slots: dict[str, int] = {}
        self._free: list[int] = list(reversed(range(capacity)))
        self._members: list[nameservice_pb2.Member | None] = [None] * capacity
        self._id_hash = np.zeros(capacity, dtype=np.uint64)  # rendezvous.hash64(member id)
        self.loras: list[frozenset[str]] = [frozenset()] * capacity
        self.resident_loras: list[frozenset[str]] = [frozenset()] * capacity
        self._hosts: dict[str, int] = {}
        self._order: dict[int, np.ndarray] | None = None  # None: rebuild

    # -- membership ------------------------------------------------------------------------
    def add(self, member: nameservice_pb2.Member) -> None:
        slot = self._slots.get(member.id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._slots[member.id] = self._free.pop()
            self._id_hash[slot] = rendezvous.hash64(member.id)
            self._order = None
        elif self._members[slot].role != member.role:
            self._order = None
        self._members[slot] = member
        host = member.address.rpartition(":")[0]
        self._ints[_I["host"], slot] = self._hosts.setdefault(host, len(self._hosts))

    def remove(self, worker_id: str) -> None:
        slot = self._slots.pop(worker_id, None)
        if slot is None:
            return
        self._members[slot] = None
        self._clear(slot)
        self._free.append(slot)
        self._order = None

    def _clear(self, slot: int) -> None:
        self._floats[:, slot] = 0.0
        self._floats[_F["arrival"], slot] = -math.inf
        self._ints[:, slot] = 0
        self.loras[slot] = self.resident_loras[slot] = frozenset()

    def _grow(self) -> None:
        old = self._floats.shape[1]
        self._floats = np.concatenate([self._floats, np.zeros((len(FLOATS), old))], axis=1)
        self._floats[_F["arrival"], old:] = -math.inf
        self._ints = np.concatenate([self._ints, np.zeros((len(INTS), old), np.int64)], axis=1)
        self._members.extend([None] * old)
        self._id_hash = np.concatenate([self._id_hash, np.zeros(old, np.uint64)])
        self.loras.extend([frozenset()] * old)
        self.resident_loras.extend([frozenset()] * old)
        self._free.extend(reversed(range(old, 2 * old)))

    # -- updates ---------------------------------------------------------------------------
    def set_load(self, worker_id: str, report: events_pb2.LoadReport, arrival: float) -> None:
        slot = self._slots.get(worker_id)
        if slot is None:
            return
        fits = {}
        for c in report.fetch_costs:  # the first of each tier counts (cost.fetch_cost)
            fits.setdefault(c.tier, (c.fixed_s, c.byte_s))
        host, remote, transfer = (fits.get(tier, (0.0, 0.0)) for tier in _TIERS)
        fixed, token, row = report.step_fixed_s, report.step_token_s, report.step_row_s
        running = report.num_running
        step_run = fixed + token * 0 + row * running  # StepCost.step_s, as written there
        self._floats[:, slot] = (
            arrival, fixed, token, row, step_run, step_run if running else 0.0,
            *host, *remote, *transfer,
        )  # fmt: skip
        self._ints[: len(_REPORT_INTS), slot] = (
            report.queued_tokens, running, report.num_waiting, report.max_num_waiting,
            report.free_blocks, report.block_size, report.kv_block_bytes,
            report.step_token_budget, fixed > 0 or token > 0, host[0] > 0 or host[1] > 0,
            report.remote_tier and (remote[0] > 0 or remote[1] > 0),
            transfer[0] > 0 or transfer[1] > 0, report.max_num_seqs,
        )  # fmt: skip
        self.loras[slot] = frozenset(report.loras)
        self.resident_loras[slot] = frozenset(report.resident_loras)

    def add_pending(self, worker_id: str, requests: int, tokens: int, blocks: int) -> None:
        """Add (or, negative, take away) charges routed to `worker_id`."""
        slot = self._slots.get(worker_id)
        if slot is not None:
            self._ints[_PENDING, slot] += (requests, tokens, blocks)

    # -- queries ---------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Every slot is below this."""
        return self._floats.shape[1]

    def slot(self, worker_id: str) -> int | None:
        return self._slots.get(worker_id)

    def member(self, slot: int) -> nameservice_pb2.Member:
        return self._members[slot]

    def pick(self, key: str, slots: np.ndarray) -> int:
        """The index in `slots` whose member wins `key`'s rendezvous (the same on every
        master replica, whatever else each holds)."""
        return rendezvous.pick(key, self._id_hash[slots])

    def order(self, role: int) -> np.ndarray:
        """The slots of `role`'s members, sorted by member id (do not modify)."""
        if self._order is None:
            by_role: dict[int, list[tuple[str, int]]] = {}
            for worker_id, slot in self._slots.items():
                by_role.setdefault(self._members[slot].role, []).append((worker_id, slot))
            self._order = {
                r: np.array([s for _, s in sorted(pairs)], dtype=np.intp)
                for r, pairs in by_role.items()
            }
        return self._order.get(role, np.empty(0, dtype=np.intp))

    def gather(self, slots: np.ndarray, now: float, load_ttl_s: float) -> Loads:
        floats, ints = self._floats.take(slots, axis=1), self._ints.take(slots, axis=1)
        # ClusterView.load: a report older than the TTL is none.
        fresh = ~((now - floats[_F["arrival"]]) > load_ttl_s)
        if not fresh.all():
            stale = np.flatnonzero(~fresh)
            floats[:, stale] = 0.0
            ints[: len(_REPORT_INTS), stale] = 0
        for col, default in ((_I["block_size"], DEFAULT_BLOCK_SIZE), (_I["kv_block_bytes"], 1)):
            row = ints[col]  # `report.block_size or DEFAULT_BLOCK_SIZE`, `... or 1`
            row[row <= 0] = default
        return Loads(floats, ints, fresh)

    # -- invariants ------------------------------------------------------------------------
    def check(
        self,
        members: dict[str, nameservice_pb2.Member],
        pending: dict[str, tuple[int, int, int]],
    ) -> None:
        """The table has a slot for exactly the `members`, and their pending sums."""
        assert self._slots.keys() == members.keys(), "table slots differ from the members"
        for worker_id, slot in self._slots.items():
            assert self._members[slot] is members[worker_id], f"stale member in {worker_id}"
            sums = tuple(int(x) for x in self._ints[_PENDING, slot])
            assert sums == pending.get(worker_id, (0, 0, 0)), f"pending of {worker_id}: {sums}"
        assert not set(self._free) & set(self._slots.values()), "a used slot is free"
