"""The grammar masks of a step's constrained rows, computed beside the forward pass.

A row's mask depends only on its grammar's state, which nothing changes while the model
runs (guides advance in the scheduler, after sampling). So the runner starts the masks of
the rows it is about to sample before the forward pass, on a worker thread, and the
sampler collects them after it:

    engine thread   start(rows) ──> forward (torch) ─────────────> wait() -> add biases, sample
    mask worker         └──> llguidance fills bitmask ─> bits to 0/-inf biases ─┘

Both sides run with the GIL released (llguidance's mask fill and numpy's take; torch's
kernels), so on a GPU host the masks are free and on a CPU host they take only idle cores.

Speculative rows: a request verifying drafts d_1..d_k samples k + 1 rows, row i after
d_1..d_i (engine/spec_decode/rejection.py). llguidance computes them in one call, advancing
through the drafts and rolling back. It stops at the first draft d_m its grammar refuses;
rows past m keep the buffer's "everything allowed". That is exact: row m's own mask is
right, so its sampled token is not d_m, the drafts are accepted at most up to m, and rows
past m are never used.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rtp_serve.core.structured import Guide, fill_bitmasks
from rtp_serve.engine.spec_decode.rejection import DraftRow

if TYPE_CHECKING:
    from rtp_serve.engine.request import Request

assert sys.byteorder == "little", "the grammar bitmask is read as bytes"
# _BYTE_BIAS[b, i]: 0 where bit i of byte b is set (allowed), -inf where not. Token t is bit
# t % 32 of word t // 32: on a little-endian host, bit t % 8 of byte t // 8.
_BYTE_BIAS = np.array(
    [[0.0 if (b >> i) & 1 else -np.inf for i in range(8)] for b in range(256)], dtype=np.float32
)


@dataclass(frozen=True, slots=True)
class Entry:
    """One request's block of constrained rows: `rows[0]` its own, then one per draft."""

    guide: Guide
    rows: range  # indices into the step's sampled rows
    drafts: tuple[int, ...]


def entries_of(rows: list[Request | DraftRow]) -> list[Entry]:
    """The constrained requests among a step's sampled rows (engine/spec_decode/rejection.rows_of
    puts a request's draft rows right after its own)."""
    out = []
    for i, r in enumerate(rows):
        if r.guide is None or isinstance(r, DraftRow):  # a draft row: in its request's entry
            continue
        nxt = rows[i + 1] if i + 1 < len(rows) else None
        drafts = nxt.drafts if isinstance(nxt, DraftRow) and nxt.request is r else ()
        out.append(Entry(r.guide, range(i, i + 1 + len(drafts)), drafts))
    return out


def compute(entries: list[Entry], vocab_size: int) -> torch.Tensor:
    """Biases [constrained rows, vocab_size] float32 (0 allowed, -inf not), the entries' rows
    in order."""
    n = sum(len(e.rows) for e in entries)
    words = (vocab_size + 31) // 32
    bitmask = np.full((n, words), -1, dtype=np.int32)  # rows past a refused draft: all allowed
    starts, k = [], 0
    for e in entries:
        starts.append(k)
        k += len(e.rows)
    rows = [(e.guide, s, list(e.drafts)) for e, s in zip(entries, starts, strict=True)]
    fill_bitmasks(rows, bitmask.ctypes.data, words, n)
    biases = np.take(_BYTE_BIAS, bitmask.view(np.uint8), axis=0)  # [n, words * 4, 8]
    return torch.from_numpy(biases.reshape(n, -1)[:, :vocab_size])


class PendingMasks:
    """The masks of one step's constrained rows, being computed (or computed)."""

    def __init__(self, entries: list[Entry], biases: Future[torch.Tensor] | torch.Tensor) -> None:
        self.entries = entries
        self._biases = biases

    @property
    def rows(self) -> list[int]:
        return [i for e in self.entries for i in e.rows]

    def biases(self) -> torch.Tensor:
        """[len(rows), vocab] float32; waits for the worker if it is still at it."""
        b = self._biases
        return b.result() if isinstance(b, Future) else b


class MaskWorker:
    """Starts a step's masks on one worker thread (created on first use: engines that never
    see a grammar never start it). `background=False` computes them on the spot instead
    (the reference bench/structured.py compares against)."""

    def __init__(self, vocab_size: int, background: bool = True) -> None:
        self.vocab_size = vocab_size
        self.background = background
        self._pool: ThreadPoolExecutor | None = None

    def start(self, rows: list[Request | DraftRow]) -> PendingMasks | None:
        """None when no row has a grammar."""
        entries = entries_of(rows)
        if not entries:
            return None
        if not self.background:
            return PendingMasks(entries, compute(entries, self.vocab_size))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return PendingMasks(entries, self._pool.submit(compute, entries, self.vocab_size))
