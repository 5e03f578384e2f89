"""16-byte KV block hashes <-> dense int ids, in numpy arrays: no Python object per hash.

The prefix index keys everything else (holders, per-worker logs) by these ids. A hash is
two little-endian uint64 words (lo, hi); they are already uniform (blake2b), so their bits
are used directly:

    _table (buckets, 16) uint32: one 64-byte cache line a bucket      _keys (ids, 2) uint64
    +------------------------------+------------------------------+    +------+------+
    | tag x 8 (lo >> 32 | 1; 0 =   | id x 8 (of the way's hash)   | -> |  lo  |  hi  |
    |          an empty way)       |                              |    +------+------+
    +------------------------------+------------------------------+
      a hash sits in one of two buckets: an even one from lo's low bits, an odd one from
      hi's (the emptier when added); a tag hit is confirmed against `_keys`.

A lookup reads two buckets, then the key of the hit: a batch of n hashes is a fixed
handful of numpy calls, whatever n. Removal clears the way's tag (no tombstones: a hash
is only ever in its two buckets). Freed ids are reused.

The loops over a batch (find, intern, discard, grow) run compiled where the install built
services/master/csrc/block_table.cpp (a plain C++ extension, no torch): one pass instead of
a dozen numpy calls, each bucket fetched a few hashes ahead; a 10M-block index rebuilds 4x
as fast (docs/operations/scale.md "The compiled index loops"). Without
it (no compiler at install, or RTP_SERVE_MASTER_NATIVE=0) the numpy code below does the same
on the same arrays; tests run both against each other.
"""

from __future__ import annotations

import os

import numpy as np

try:
    from rtp_serve.services.master import _block_table as native
except ImportError:  # not compiled at install
    native = None

WAYS = 8
MAX_LOAD = 0.8  # entries per way before the table doubles
U64 = np.dtype("<u8")
U32 = np.dtype("<u4")
ROWS = np.arange(1 << 12)


def words(joined: bytes) -> np.ndarray:
    """Concatenated 16-byte hashes -> (n, 4) uint32: lo low, lo high, hi low, hi high."""
    return np.frombuffer(joined, U32).reshape(-1, 4)


def _rows(n: int) -> np.ndarray:
    return ROWS[:n] if n <= len(ROWS) else np.arange(n)


def compiled() -> bool:
    """Whether new tables use the compiled loops (read once per table)."""
    return native is not None and os.environ.get("RTP_SERVE_MASTER_NATIVE", "1") != "0"


class BlockIds:
    def __init__(self, buckets: int = 1024, compiled_loops: bool | None = None) -> None:
        self.compiled = compiled() if compiled_loops is None else compiled_loops
        if self.compiled and native is None:
            raise RuntimeError("services/master/csrc/block_table.cpp was not compiled")
        self._resize(buckets)
        self._keys = np.zeros((1024, 2), U64)
        self._free = np.zeros(0, np.int64)  # a stack of freed ids; _nfree of them valid
        self._nfree = 0
        self._next = 0  # ids below this were handed out at some time
        self._live = 0

    def __len__(self) -> int:
        return self._live

    @property
    def limit(self) -> int:
        """Every id is below this."""
        return self._next

    def _resize(self, buckets: int) -> None:
        self._table = np.zeros((buckets, 2 * WAYS), U32)
        self._claim = np.zeros(buckets, np.int32)  # scratch: who picked each bucket
        self._mask = np.array([(buckets - 1) & ~1, buckets - 1], U32)
        self._odd = np.array([0, 1], U32)

    def _buckets(self, w: np.ndarray) -> np.ndarray:
        """(n, 2) bucket numbers: an even one, an odd one (never the same)."""
        return (w[:, ::2] & self._mask) | self._odd

    # -- lookups ---------------------------------------------------------------------------
    def find(self, w: np.ndarray) -> np.ndarray:
        """The ids of the hashes `w` (from `words`), -1 for those not here (int64)."""
        if self.compiled:
            ids = np.empty(len(w), np.int64)
            native.find(self._table, self._keys, np.ascontiguousarray(w), ids)
            return ids
        return self._find(w)[0]

    def _find(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, buckets, the buckets' rows)."""
        n = len(w)
        b = self._buckets(w)
        g = self._table[b]  # (n, 2, 16)
        ids = np.full(n, -1, np.int64)
        at = np.flatnonzero(g[:, :, :WAYS] == (w[:, 1] | 1)[:, None, None])  # about 1 a row
        if not len(at):
            return ids, b, g
        row = at // (2 * WAYS)
        ids[row] = g[row, (at // WAYS) % 2, WAYS + at % WAYS]
        wrong = (self._keys[ids] != w.view(U64)).view(np.uint16)[:, 0] != 0
        wrong &= ids >= 0
        for r in np.flatnonzero(wrong).tolist():  # another hash, same tag: ~n * 2**-28
            ids[r] = self._confirm(b[r], w[r])
        return ids, b, g

    def _confirm(self, b: np.ndarray, w: np.ndarray) -> int:
        g = self._table[b]
        for i in g[:, WAYS:][g[:, :WAYS] == (w[1] | 1)].tolist():
            if (self._keys[i] == w.view(U64)).all():
                return i
        return -1

    def keys(self, ids: np.ndarray) -> list[bytes]:
        data = self._keys[ids].tobytes()
        return [data[i : i + 16] for i in range(0, len(data), 16)]

    def live_ids(self) -> np.ndarray:
        return np.sort(self._table[:, WAYS:][self._table[:, :WAYS] != 0].astype(np.int64))

    # -- changes ---------------------------------------------------------------------------
    def intern(self, w: np.ndarray) -> np.ndarray:
        """The ids of the hashes `w` (repeats allowed), adding those not here yet."""
        if self.compiled:
            return self._intern_compiled(np.ascontiguousarray(w))
        ids, b, tags = self._find(w)
        new = np.flatnonzero(ids < 0)
        if not len(new):
            return ids
        wn = w[new]
        _, first, again = np.unique(wn.view(U64)[:, 0], return_index=True, return_inverse=True)
        if len(first) < len(new) and not (wn[first][again] == wn).all():
            seen: dict[bytes, int] = {}  # two hashes share a lo word: by their bytes
            again = np.array([seen.setdefault(k.tobytes(), len(seen)) for k in wn])
            first = np.unique(again, return_index=True)[1]
        ids[new] = self._add(wn[first], b[new][first], tags[new][first])[again]
        return ids

    def _intern_compiled(self, w: np.ndarray) -> np.ndarray:
        ids = np.empty(len(w), np.int64)
        self._make_room(max(0, len(w) - self._nfree))
        done = 0
        while done < len(w):
            n, self._nfree, self._next, added = native.intern(
                self._table, self._keys, w[done:], ids[done:], self._free, self._nfree, self._next
            )
            self._live += added
            done += n
            if done < len(w) or self._live > MAX_LOAD * len(self._table) * WAYS:
                self._grow()  # both of a hash's buckets full, or the load past MAX_LOAD
        return ids

    def _make_room(self, new: int) -> None:
        """Key rows for `new` more ids past `_next`."""
        if self._next + new > len(self._keys):
            grown = np.zeros((max(self._next + new, 2 * len(self._keys)), 2), U64)
            grown[: len(self._keys)] = self._keys
            self._keys = grown

    def _add(self, w: np.ndarray, b: np.ndarray, tags: np.ndarray) -> np.ndarray:
        n = len(w)
        take = min(n, self._nfree)
        ids = np.empty(n, np.int64)
        ids[:take] = self._free[self._nfree - take : self._nfree][::-1]
        self._nfree -= take
        ids[take:] = np.arange(self._next, self._next + n - take)
        self._make_room(n - take)
        self._next += n - take
        self._keys[ids] = w.view(U64)
        self._live += n
        if self._live > MAX_LOAD * len(self._table) * WAYS:
            while self._live > MAX_LOAD * len(self._table) * WAYS:
                self._grow()
            b = self._buckets(w)
            tags = self._table[b]
        left = self._place(ids, w, b, tags)
        while len(left):  # both buckets full: rare below MAX_LOAD
            self._grow()
            wl = self._keys[left].view(U32)
            bl = self._buckets(wl)
            left = self._place(left, wl, bl, self._table[bl])
        return ids

    def discard(self, ids: np.ndarray) -> None:
        """Forget these ids (live, distinct); they are handed out again later."""
        if not len(ids):
            return
        if self.compiled:
            native.discard(self._table, self._keys, np.ascontiguousarray(ids, np.int64))
        else:
            b = self._buckets(self._keys[ids].view(U32))
            g = self._table[b]
            mine = (g[:, :, WAYS:] == ids[:, None, None]) & (g[:, :, :WAYS] != 0)
            way = mine.reshape(len(ids), 2 * WAYS).argmax(axis=1)
            self._table[b[_rows(len(ids)), way // WAYS], way % WAYS] = 0
        if self._nfree + len(ids) > len(self._free):
            grown = np.zeros(max(2 * len(self._free), self._nfree + len(ids), 1024), np.int64)
            grown[: self._nfree] = self._free[: self._nfree]
            self._free = grown
        self._free[self._nfree : self._nfree + len(ids)] = ids
        self._nfree += len(ids)
        self._live -= len(ids)

    def _place(
        self, ids: np.ndarray, w: np.ndarray, b: np.ndarray, rows_: np.ndarray
    ) -> np.ndarray:
        """Put hashes into the emptier of their two buckets (`rows_`: those buckets' rows).
        Of those that pick the same bucket one goes in per round; from the third round on,
        the k-th of them takes the bucket's k-th free way. Returns the ids not placed (when
        one finds both its buckets full, all of those left: the table has to grow)."""
        tag = w[:, 1] | 1
        for round_ in range(64):
            rows = _rows(len(ids))
            free = rows_[:, :, :WAYS] == 0
            nfree = free.sum(axis=2)
            side = nfree.argmax(axis=1)
            bucket, free, nfree = b[rows, side], free[rows, side], nfree[rows, side]
            if not nfree.all():
                return ids  # some found both buckets full: all of these wait for a grow
            self._claim[bucket] = rows
            go = self._claim[bucket] == rows  # the last of each bucket's claimants
            if round_ < 2 or go.all():
                way = free.argmax(axis=1)
            else:
                order = np.argsort(bucket, kind="stable")
                first = np.ones(len(ids), bool)
                first[1:] = bucket[order[1:]] != bucket[order[:-1]]
                rank = np.empty(len(ids), np.intp)
                rank[order] = rows - np.maximum.accumulate(np.where(first, rows, 0))
                go = rank < nfree
                way = (np.cumsum(free, axis=1) > rank[:, None]).argmax(axis=1)
            self._table[bucket[go], way[go]] = tag[go]
            self._table[bucket[go], WAYS + way[go]] = ids[go]
            if go.all():
                return ids[:0]
            ids, tag, b = ids[~go], tag[~go], b[~go]
            rows_ = self._table[b]
        return ids

    def _grow(self) -> None:
        """Twice the buckets. The masks gain one bit, so bucket i's entries split between
        i and i + old size by that bit of their word (lo in even buckets, hi in odd ones):
        no hash is placed again.

            old  [ b0 | b1 | ... | bB-1 ]  ->  new  [ b0 | b1 | ... | bB-1 | bB | ... ]
                   entries with the bit set move up by B; the rest stay
        """
        old = self._table
        size = len(old)
        self._resize(2 * size)
        if self.compiled:
            native.grow(old, self._table, self._keys)
            return
        self._table[:size] = old
        self._table[size:] = old
        step = 1 << 16
        for start in range(0, size, step):
            part = old[start : start + step]
            keys = self._keys[part[:, WAYS:].astype(np.intp)]  # (rows, 8, 2); stale ids too
            odd = (np.arange(start, start + len(part)) % 2 == 1)[:, None]
            up = (np.where(odd, keys[:, :, 1], keys[:, :, 0]) & np.uint64(size)) != 0
            self._table[start : start + len(part), :WAYS][up] = 0
            self._table[size + start : size + start + len(part), :WAYS][~up] = 0

    def nbytes(self) -> dict[str, int]:
        table = self._table.nbytes + self._claim.nbytes
        return {"hash table": table, "keys by id": self._next * 16 + self._nfree * 8}

    # -- invariants ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        ids = self.live_ids()  # sorted
        assert len(ids) == self._live, f"{len(ids)} entries for {self._live} live ids"
        assert not (ids[1:] == ids[:-1]).any(), "an id in the table twice"
        assert not np.isin(self._free[: self._nfree], ids).any(), "a free id in the table"
        assert len(ids) + self._nfree == self._next, "ids neither live nor free"
        for part in np.split(ids, range(1 << 16, len(ids), 1 << 16)):
            assert (self.find(self._keys[part].view(U32)) == part).all(), "a hash not found"
