"""The low-rank updates of one step, batched across rows with different adapters.

The base projection runs once over every row; then, per adapter in the step, its rows get
`(x A) B` added (weights.py: A and B already fused like the base projection). The model
runner orders a step's rows by adapter within its decode and prefill parts, so an
adapter's rows are at most two contiguous runs; each run is two small GEMMs on slices,
with no gather or scatter:

    rows:   | decodes: a a b - - | prefills: a a a b b - - - |      (- : the base model)
    runs:     a [0,2) b [2,3)      a [5,8) b [8,10)

(Measured against one batched gather of per-row A/B: bench/lora.py.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.weights import LoraWeights


@dataclass(frozen=True, slots=True)
class LoraRun:
    start: int
    end: int
    weights: LoraWeights


@dataclass(frozen=True, slots=True)
class LoraBatch:
    runs: tuple[LoraRun, ...]

    @classmethod
    def of_rows(cls, row_adapters: list[tuple[int, str]], resident: dict[str, LoraWeights]):
        """`row_adapters`: (number of rows, adapter name or "") per scheduled item, in row
        order. Returns None when no row uses an adapter."""
        runs: list[LoraRun] = []
        row = 0
        for n, name in row_adapters:
            if name:
                last = runs[-1] if runs else None
                if last is not None and last.end == row and last.weights.config.name == name:
                    runs[-1] = LoraRun(last.start, row + n, last.weights)
                else:
                    runs.append(LoraRun(row, row + n, resident[name]))
            row += n
        return cls(tuple(runs)) if runs else None

    def add(self, layer: int, proj: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += (x[rows] A) B for each run's adapter, in place."""
        for run in self.runs:
            pair = run.weights.layers[layer][proj]
            if pair is not None:
                s = slice(run.start, run.end)
                y[s].addmm_(torch.mm(x[s], pair.a), pair.b)
