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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.weights import LoraPair, LoraPart, LoraWeights, MatMul


@dataclass(frozen=True, slots=True)
class StackedPair:
    a: torch.Tensor  # [in, C]
    parts: tuple[LoraPart, ...]  # per fused part: its columns of t, of y, and B [r, out]
    col_slot: torch.Tensor  # [C]: which resident slot each column of t belongs to
    layout: tuple[tuple[int, int], ...]  # (slot, width) per column run: the mask's cache key


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
                    _stack([(s, w.layers[i][p]) for s, w in enumerate(adapters)])
                    for p in range(len(adapters[0].layers[i]))
                )
            )
        return cls(tuple(w.config.name for w in adapters), layers)


def _stack(pairs: list[tuple[int, LoraPair | None]]) -> StackedPair | None:
    """One projection of every resident adapter (slot, pair): A's columns part by part."""
    # Output column ranges of the fused parts, in order, as any adapter targets them.
    spans = sorted({(p.cols.start, p.cols.stop) for _, pair in pairs if pair for p in pair.parts})
    if not spans:
        return None
    a_cols: list[torch.Tensor] = []
    layout: list[tuple[int, int]] = []
    parts: list[LoraPart] = []
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
        parts.append(LoraPart(slice(c0, c), slice(start, stop), torch.cat(bs).contiguous()))
    col_slot = torch.cat([torch.full((w,), s) for s, w in layout])
    return StackedPair(torch.cat(a_cols, dim=1).contiguous(), tuple(parts), col_slot, tuple(layout))


class StackedRows:
    """The decode rows [0, n) of one step over a `Stacked` set; masks made once per step."""

    def __init__(
        self, stacked: Stacked, row_names: list[str], dtype: torch.dtype, mm: MatMul
    ) -> None:
        self.mm = mm
        slot = {name: i for i, name in enumerate(stacked.names)}
        self.stacked = stacked
        self.n = len(row_names)
        self._row_slot = torch.tensor([slot.get(name, -1) if name else -1 for name in row_names])
        self._dtype = dtype
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}

    def add(self, layer: int, proj: int, x: torch.Tensor, y: torch.Tensor) -> None:
        pair = self.stacked.layers[layer][proj]
        if pair is None:
            return
        mask = self._masks.get(pair.layout)
        if mask is None:
            mask = (self._row_slot[:, None] == pair.col_slot[None, :]).to(self._dtype)
            self._masks[pair.layout] = mask.to(x.device)
        whole = x.shape[0] == self.n  # a decode-only step: no views to make
        t = self.mm(x if whole else x[: self.n], pair.a).mul_(mask)
        out = y if whole else y[: self.n]
        for part in pair.parts:
            out[:, part.cols].add_(self.mm(t[:, part.rows], part.b))
