"""Every resident adapter's A and B side by side: the decode rows' update in two GEMMs.

Decode rows are few (one token each), so per-adapter GEMMs there cost kernel launches, not
FLOPs. Instead each projection's resident adapters are stacked once (on a swap), and the
decode rows' update runs over all of them at once, a 0/1 mask keeping each row to its own
adapter's columns:

    t = x [T, in] @ [A_0 | A_1 | ... ]       -> [T, C]      C = sum of the adapters' ranks
    t *= mask  (row i keeps only the columns of its adapter; a base row keeps none)
    y += t @ [B_0 ; B_1 ; ... ]               -> [T, out]

The extra work is T x in x C multiply-adds, a few per cent of the base projection at decode
sizes; prefill chunks (many rows) use per-adapter runs instead (batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.weights import LoraWeights


@dataclass(frozen=True, slots=True)
class StackedPair:
    a: torch.Tensor  # [in, C]
    b: torch.Tensor  # [C, out]
    col_slot: torch.Tensor  # [C]: which resident slot each column belongs to
    layout: tuple[tuple[int, int], ...]  # (slot, width) per adapter: the mask's cache key


@dataclass(frozen=True, slots=True)
class Stacked:
    names: tuple[str, ...]  # slot -> adapter
    layers: list[tuple[StackedPair | None, ...]]

    @classmethod
    def build(cls, adapters: list[LoraWeights]) -> Stacked:
        layers = []
        for i in range(len(adapters[0].layers) if adapters else 0):
            fused: list[StackedPair | None] = []
            for proj in range(len(adapters[0].layers[i])):
                parts = [
                    (slot, w.layers[i][proj])
                    for slot, w in enumerate(adapters)
                    if w.layers[i][proj] is not None
                ]
                if not parts:
                    fused.append(None)
                    continue
                layout = tuple((slot, p.a.shape[1]) for slot, p in parts)
                fused.append(
                    StackedPair(
                        torch.cat([p.a for _, p in parts], dim=1).contiguous(),
                        torch.cat([p.b for _, p in parts], dim=0).contiguous(),
                        torch.cat([torch.full((w,), s) for s, w in layout]),
                        layout,
                    )
                )
            layers.append(tuple(fused))
        return cls(tuple(w.config.name for w in adapters), layers)


class StackedRows:
    """The decode rows [0, n) of one step over a `Stacked` set; masks made once per step."""

    def __init__(self, stacked: Stacked, row_names: list[str], dtype: torch.dtype) -> None:
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
        t = torch.mm(x[: self.n], pair.a).mul_(mask)
        y[: self.n].addmm_(t, pair.b)
