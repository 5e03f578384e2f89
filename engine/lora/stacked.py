"""Every resident adapter's A and B side by side: the decode rows' update in two GEMMs.

Decode rows are few (one token each), so per-adapter GEMMs there cost kernel launches, not
FLOPs. Instead each projection's resident adapters are stacked once (on a swap), and the
decode rows' update runs over all of them at once, a 0/1 mask keeping each row to its own
adapter's columns:

    t = x [T, in] @ [A_0 | A_1 | ... ]       -> [T, C]      C = sum of the adapters' ranks
    t *= mask  (row i keeps only the columns of its adapter; a base row keeps none)
    y += t @ [B_0 ; B_1 ; ... ]               -> [T, out]

(A fused projection has that last GEMM once per part, q/k/v or gate/up: t's columns are
ordered part first, then adapter, so each part's columns and B's rows are contiguous.)

The extra work is T x in x C multiply-adds, a few per cent of the base projection at decode
sizes; prefill chunks (many rows) use per-adapter runs instead (batch.py).

Where the compiled CPU kernels are there (float32), `lora_rows` (kernels/csrc/lora_rows.cpp)
does the same in one call per projection without the mask: rows sharing an adapter are
taken together, each reads only its own adapter's A rows and B rows, so an adapter's bytes
are read once a step and no row multiplies another adapter's columns. For it A is kept
transposed ([C, in], a row per column of t) and the B's flat, each column of t naming the
slice of the flat buffer it adds and the output columns it adds it to; the torch path reads
the same tensors (A through a transposed view, B through views of the flat buffer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rtp_serve.engine.lora.weights import LoraPair, LoraPart, LoraWeights

# kernels' lora_rows(x, y, row_slot, a_t, col_slot, b_flat, b_off, b_col0, b_len): in place.
RowsKernel = Callable[..., None]


@dataclass(frozen=True, slots=True)
class StackedPair:
    a_t: torch.Tensor  # [C, in]: A transposed, a row per column of t
    parts: tuple[LoraPart, ...]  # per fused part: its columns of t, of y, and B [r, out]
    col_slot: torch.Tensor  # [C]: which resident slot each column of t belongs to
    layout: tuple[tuple[int, int], ...]  # (slot, width) per column run: the mask's cache key
    b_flat: torch.Tensor  # every part's B back to back (the parts' b are views of it)
    b_off: torch.Tensor  # [C]: where column c's B row starts in b_flat
    b_col0: torch.Tensor  # [C]: the first output column it adds to
    b_len: torch.Tensor  # [C]: how many (its part's width)


@dataclass(frozen=True, slots=True)
class Stacked:
    names: tuple[str, ...]  # slot -> adapter
    layers: list[tuple[StackedPair | None, ...]]

    @classmethod
    def build(cls, adapters: list[LoraWeights]) -> Stacked:
        layers = []
        for i in range(len(adapters[0].layers) if adapters else 0):
            layers.append(
                tuple(
                    stack_pairs([(s, w.layers[i][p]) for s, w in enumerate(adapters)])
                    for p in range(len(adapters[0].layers[i]))
                )
            )
        return cls(tuple(w.config.name for w in adapters), layers)


def stack_pairs(pairs: list[tuple[int, LoraPair | None]]) -> StackedPair | None:
    """One projection of every resident adapter (slot, pair): A's columns part by part."""
    # Output column ranges of the fused parts, in order, as any adapter targets them.
    spans = sorted({(p.cols.start, p.cols.stop) for _, pair in pairs if pair for p in pair.parts})
    if not spans:
        return None
    a_cols: list[torch.Tensor] = []
    layout: list[tuple[int, int]] = []
    part_bs: list[tuple[int, int, int, list[torch.Tensor]]] = []  # (c0, c1, first col, B's)
    c = 0
    for start, stop in spans:
        bs, c0 = [], c
        for slot, pair in pairs:
            for p in pair.parts if pair else ():
                if (p.cols.start, p.cols.stop) == (start, stop):
                    a_cols.append(pair.a[:, p.rows])
                    bs.append(p.b)
                    layout.append((slot, p.b.shape[0]))
                    c += p.b.shape[0]
        part_bs.append((c0, c, start, bs))
    b_flat = torch.cat([b.reshape(-1) for *_, bs in part_bs for b in bs])
    parts: list[LoraPart] = []
    b_off, b_col0, b_len = [], [], []
    offset = 0
    for c0, c1, start, bs in part_bs:
        width = bs[0].shape[1]
        b = b_flat[offset : offset + (c1 - c0) * width].view(c1 - c0, width)
        parts.append(LoraPart(slice(c0, c1), slice(start, start + width), b))
        b_off += range(offset, offset + (c1 - c0) * width, width)
        b_col0 += [start] * (c1 - c0)
        b_len += [width] * (c1 - c0)
        offset += (c1 - c0) * width
    col_slot = torch.cat([torch.full((w,), s) for s, w in layout])
    return StackedPair(
        a_t=torch.cat(a_cols, dim=1).t().contiguous(),
        parts=tuple(parts),
        col_slot=col_slot,
        layout=tuple(layout),
        b_flat=b_flat,
        b_off=torch.tensor(b_off, dtype=torch.int64),
        b_col0=torch.tensor(b_col0, dtype=torch.int64),
        b_len=torch.tensor(b_len, dtype=torch.int64),
    )


class StackedRows:
    """The decode rows [0, n) of one step over a `Stacked` set: by the compiled `kernel`
    where given, else masked GEMMs (masks made once per step)."""

    def __init__(
        self,
        stacked: Stacked,
        row_names: list[str],
        dtype: torch.dtype,
        kernel: RowsKernel | None = None,
    ) -> None:
        slot = {name: i for i, name in enumerate(stacked.names)}
        self.stacked = stacked
        self.n = len(row_names)
        self._row_slot = torch.tensor([slot.get(name, -1) if name else -1 for name in row_names])
        self._kernel = kernel
        self._dtype = dtype
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}

    def add(self, layer: int, proj: int, x: torch.Tensor, y: torch.Tensor) -> None:
        pair = self.stacked.layers[layer][proj]
        if pair is None:
            return
        whole = x.shape[0] == self.n  # a decode-only step: no views to make
        x = x if whole else x[: self.n]
        out = y if whole else y[: self.n]
        if self._kernel is not None:
            self._kernel(
                x, out, self._row_slot, pair.a_t, pair.col_slot,
                pair.b_flat, pair.b_off, pair.b_col0, pair.b_len,
            )  # fmt: skip
            return
        mask = self._masks.get(pair.layout)
        if mask is None:
            mask = (self._row_slot[:, None] == pair.col_slot[None, :]).to(self._dtype)
            self._masks[pair.layout] = mask.to(x.device)
        t = torch.mm(x, pair.a_t.t()).mul_(mask)
        for part in pair.parts:
            out[:, part.cols].add_(torch.mm(t[:, part.rows], part.b))
