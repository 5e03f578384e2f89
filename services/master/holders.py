"""Which workers hold each block id, and which ids each worker holds: the prefix index's
pairs, in numpy arrays indexed by small ints (block ids from BlockIds, worker slots here).

    worker id (str) --slot--> s (small int; freed when the worker holds nothing, reused)

    _inline  (ids + 1, 4) int16   up to 4 holders' slots per id, -1 = none, holes anywhere;
                                  the last row stays empty: it is what id -1 (no hash) reads
    _nheld   (ids + 1,)   int32   holders per id (0: the id is free)
    _more    {id: slots}          holders past the 4th; only while the row is full
    _log[s]               int32   ids slot s stored, with stale ones (since removed, or
                                  reused for another hash): filtered through _inline/_more
                                  when read, compacted when more than half stale
    count[s]                      pairs per slot

Chained keys have few holders each (1-3), so `_more` stays small: a system prompt that
every worker holds is a few dozen ids.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

INLINE = 4  # holders in an id's row: their flags make one uint32 (_any_in_row)
SHORT = 256  # prefixes up to this long are walked in Python by `runs`


class Holders:
    def __init__(self) -> None:
        self._inline = np.full((1025, INLINE), -1, np.int16)
        self._nheld = np.zeros(1025, np.int32)
        self._ready = 0  # rows below this are initialized
        self._more: dict[int, np.ndarray] = {}
        self.slot: dict[str, int] = {}
        self.names: list[str | None] = []
        self._free_slots: list[int] = []
        self._log: list[np.ndarray] = []
        self._logged: list[int] = []
        self.count: list[int] = []
        self.pairs = 0

    def ensure(self, limit: int) -> None:
        """Rows for ids below `limit`."""
        if limit <= self._ready:
            return
        if limit >= len(self._nheld):
            size = max(limit, 2 * len(self._nheld)) + 1
            inline = np.empty((size, INLINE), self._inline.dtype)
            inline[: self._ready] = self._inline[: self._ready]
            inline[-1] = -1
            nheld = np.empty(size, np.int32)
            nheld[: self._ready] = self._nheld[: self._ready]
            nheld[-1] = 0
            self._inline, self._nheld = inline, nheld
        self._inline[self._ready : limit] = -1
        self._nheld[self._ready : limit] = 0
        self._ready = limit

    # -- queries ---------------------------------------------------------------------------
    def nheld(self, ids: np.ndarray) -> np.ndarray:
        return self._nheld[ids]

    def held(self, ids: np.ndarray, slots: np.ndarray | int) -> np.ndarray:
        """Whether each id is held by its slot (or by `slots`, one for all)."""
        mine = _any_in_row(self._inline[ids] == np.reshape(slots, (-1, 1)))
        if self._more:
            for i in np.flatnonzero(~mine & (self._nheld[ids] > INLINE)).tolist():
                s = slots if isinstance(slots, int) else slots[i]
                mine[i] = bool((self._more[int(ids[i])] == s).any())
        return mine

    def any_of(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Whether some slot in `mask` (a bool per slot, then False for none) holds each id."""
        some = _any_in_row(mask[self._inline[ids]])
        if self._more:
            for i in np.flatnonzero(~some & (self._nheld[ids] > INLINE)).tolist():
                some[i] = bool(mask[self._more[int(ids[i])]].any())
        return some

    def slot_mask(self, worker_ids: Iterable[str]) -> np.ndarray | None:
        slots = [self.slot[w] for w in set(worker_ids) if w in self.slot]
        if not slots:
            return None
        mask = np.zeros(len(self.names) + 1, bool)
        mask[slots] = True
        return mask

    def runs(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, lengths): for each slot holding ids[0], how many leading `ids` it holds.

        Each (slot, position) pair of the prefix, sorted: a slot's run is unbroken while
        its k-th pair is at position k.

            positions  0 1 2 3 4          slot 3: 0 1 2 4  -> run 3
            slot 3     x x x . x          slot 7: 0 1      -> run 2
            slot 7     x x . . .          slot 9: 2 3      -> none
        """
        m = len(ids)
        rows = self._inline[ids]
        over = np.flatnonzero(self._nheld[ids] > INLINE) if self._more else ()
        if not len(over):  # the usual case: a few holders, each checked down the rows
            found = sorted(s for s in rows[0].tolist() if s >= 0)
            lengths = []
            if m <= SHORT:  # numpy's per-call cost is more than the loop's
                listed = rows.tolist()
                for s in found:
                    k = 1
                    while k < m and s in listed[k]:
                        k += 1
                    lengths.append(k)
            else:
                for s in found:
                    miss = ~_any_in_row(rows == s)
                    k = int(miss.argmax())
                    lengths.append(k if miss[k] else m)
            return np.array(found, np.int64), np.array(lengths, np.int64)
        flat = rows.ravel()
        at = np.flatnonzero(flat >= 0)
        slots, pos = flat[at].astype(np.int64), at // INLINE
        if len(over):
            more = [self._more[int(ids[i])] for i in over]
            slots = np.concatenate([slots, *more]).astype(np.int64)
            pos = np.concatenate([pos, np.repeat(over, [len(x) for x in more])])
        key = np.sort(slots * m + pos)
        slots, pos = np.divmod(key, m)
        k = np.arange(len(key))
        first = np.ones(len(key), bool)
        first[1:] = slots[1:] != slots[:-1]
        run = pos == k - np.maximum.accumulate(np.where(first, k, 0))
        return np.unique(slots[run], return_counts=True)

    def held_ids(self, s: int, used: int | None = None) -> np.ndarray:
        """The ids slot `s` holds, each once (of the first `used` in its log)."""
        ids = np.unique(self._log[s][: self._logged[s] if used is None else used])
        return ids[self.held(ids, s)].astype(np.int64)

    # -- changes ---------------------------------------------------------------------------
    def slot_of(self, worker_id: str) -> int:
        """The worker's slot; a new one if it has none."""
        s = self.slot.get(worker_id)
        if s is not None:
            return s
        if self._free_slots:
            s = self._free_slots.pop()
            self.names[s] = worker_id
        else:
            s = len(self.names)
            if s > np.iinfo(self._inline.dtype).max:
                self._inline = self._inline.astype(np.int32)
            self.names.append(worker_id)
            self._log.append(np.zeros(0, np.int32))
            self._logged.append(0)
            self.count.append(0)
        self.slot[worker_id] = s
        return s

    def release_empty(self, slots: Iterable[int]) -> None:
        """Give back the slots among `slots` that hold nothing."""
        for s in set(slots):
            if self.names[s] is not None and not self.count[s]:
                del self.slot[self.names[s]]
                self.names[s] = None
                self._log[s], self._logged[s] = np.zeros(0, np.int32), 0
                self._free_slots.append(s)

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Each slot now holds its id (pairs distinct, none held yet; ids sorted)."""
        if not len(ids):
            return
        n = len(ids)
        k = np.arange(n)
        first = np.ones(n, bool)
        first[1:] = ids[1:] != ids[:-1]
        rank = k - np.maximum.accumulate(np.where(first, k, 0))  # among pairs of its id
        free = self._inline[ids] < 0
        fits = rank < free.sum(axis=1)
        if rank.any():  # the k-th new holder of an id takes its row's k-th free way
            way = (np.cumsum(free, axis=1) > rank[:, None]).argmax(axis=1)
        else:
            way = free.argmax(axis=1)
        self._inline[ids[fits], way[fits]] = slots[fits]
        for i in np.flatnonzero(~fits).tolist():  # the row is full: past it
            j = int(ids[i])
            self._more[j] = np.append(self._more.get(j, np.zeros(0, self._inline.dtype)), slots[i])
        starts = np.flatnonzero(first)  # ids sorted: each distinct id once, with its pairs
        self._nheld[ids[starts]] += np.diff(starts, append=n).astype(np.int32)
        self.pairs += n
        order = np.argsort(slots, kind="stable")
        bounds = np.flatnonzero(np.diff(slots[order])) + 1
        for part in np.split(order, bounds):
            s = int(slots[part[0]])
            self.count[s] += len(part)
            self._append_log(s, ids[part])

    def drop(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Each slot no longer holds its id (pairs distinct, each held now); slots left
        with nothing keep their number until `release_empty`."""
        if not len(ids):
            return
        big = self._nheld[ids] > INLINE
        if big.any():  # _more involved: one pair at a time
            for j, s in zip(ids[big].tolist(), slots[big].tolist(), strict=True):
                row, more = self._inline[j], self._more.pop(j, None)
                if not (row == s).any():
                    more = more[more != s]
                elif more is not None:  # the hole takes one of those past the row
                    row[(row == s).argmax()], more = more[-1], more[:-1]
                else:
                    row[(row == s).argmax()] = -1
                if more is not None and len(more):
                    self._more[j] = more
            small = ~big
            ids_s, slots_s = ids[small], slots[small]
        else:
            ids_s, slots_s = ids, slots
        way = (self._inline[ids_s] == slots_s[:, None]).argmax(axis=1)
        self._inline[ids_s, way] = -1
        np.subtract.at(self._nheld, ids, 1)
        self.pairs -= len(ids)
        per_slot = np.bincount(slots, minlength=len(self.names))
        for s in np.flatnonzero(per_slot).tolist():
            self.count[s] -= int(per_slot[s])

    def _append_log(self, s: int, ids: np.ndarray) -> None:
        used, log_ = self._logged[s], self._log[s]
        if used + len(ids) > len(log_):
            if used > 2 * (self.count[s] - len(ids)):  # mostly stale: compact first
                held = self.held_ids(s, used)
                used = len(held)
                log_[:used] = held
            if used + len(ids) > len(log_):
                grown = np.zeros(max(64, 2 * (used + len(ids))), np.int32)
                grown[:used] = log_[:used]
                self._log[s] = log_ = grown
        log_[used : used + len(ids)] = ids
        self._logged[s] = used + len(ids)

    # -- invariants ------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        more = sum(a.nbytes + 112 for a in self._more.values()) + 64 * len(self._more)
        return {
            "holders by id": self._ready * (self._inline.itemsize * INLINE + 4),
            "extra holders": more,
            "worker logs": sum(self._logged) * 4,
        }

    def check_integrity(self, live: np.ndarray) -> None:
        """`live` (the ids in use) have holders, counted right, each once; the rest none;
        every slot's count and log agree with them."""
        ready = self._nheld[: self._ready]
        assert (ready[live] > 0).all(), "empty holder set kept for a hash"
        dead = np.ones(self._ready, bool)
        dead[live] = False
        assert (ready[dead] == 0).all() and (self._inline[: self._ready][dead] < 0).all()
        rows = self._inline[live]
        filled = (rows >= 0).sum(axis=1)
        assert (filled == np.minimum(ready[live], INLINE)).all(), "holder count off"
        over = live[ready[live] > INLINE].tolist()
        assert set(self._more) == set(over), "holders past a row that is not full"
        for i in over:
            assert len(self._more[i]) == self._nheld[i] - INLINE, "extra holders miscounted"
            row = np.concatenate([self._inline[i], self._more[i]])
            assert len(np.unique(row)) == len(row), "a holder twice"
        srt = np.sort(rows, axis=1)
        assert not ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(), "a holder twice"
        every = np.concatenate([rows[rows >= 0], *(self._more[i] for i in over)])
        per_slot = np.bincount(every.astype(np.int64), minlength=len(self.names))
        for s, name in enumerate(self.names):
            assert (name is None) == (per_slot[s] == 0), f"slot {s} ({name}) holds {per_slot[s]}"
            if name is not None:
                assert self.slot[name] == s and self.count[s] == per_slot[s], name
                assert len(self.held_ids(s)) == self.count[s], f"log of {name} misses ids"
        assert len(self.slot) == len(self.names) - len(self._free_slots)
        assert sum(self.count[s] for s in self.slot.values()) == self.pairs


def _any_in_row(hit: np.ndarray) -> np.ndarray:
    """`hit.any(axis=1)` for (n, INLINE) bools, as one 4-byte word a row (numpy's
    reduction over a short axis loops per row)."""
    return hit.view(np.uint32)[:, 0] != 0
