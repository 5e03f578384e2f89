"""The low-rank updates of one step, batched across rows with different adapters.

The base projection runs once over every row; then each row gets its adapter's `(x A) B`
added (weights.py: A and B already fused like the base projection). The model runner orders
a step's rows by adapter within its decode and prefill parts:

    rows:   | decodes: a a b - - | prefills: a a a b b - - - |      (- : the base model)
    decode rows: one masked pass over every resident adapter (stacked.py)
    prefill rows: per-adapter runs, a [5,8) b [8,10): two GEMMs on slices each

Decode rows are few and many adapters may be among them, so there one launch per
adapter would dominate (on the CPU kernels one `lora_rows` call per projection takes every
decode row, each with its own adapter); prefill chunks are long, so there per-adapter GEMMs
do only the work needed. (Measured, with a gathered per-row A/B as well: bench/lora.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rtp_serve.engine.lora.stacked import RowsKernel, Stacked, StackedRows
from rtp_serve.engine.lora.weights import LoraWeights, MatMul

# Up to this many decode rows, their update runs over the stacked adapters (stacked.py):
# a GEMM launch per adapter costs more than the masked columns there.
STACKED_MAX_ROWS = 32  # kernels.linear.SMALL_M: where the compiled small GEMM pays


@dataclass(frozen=True, slots=True)
class LoraOps:
    """The compiled kernels LoRA updates use where there are some (lora_ops)."""

    small_mm: MatMul = torch.mm  # the GEMM for decode-sized runs
    rows: RowsKernel | None = None  # the decode rows over the stacked adapters


def lora_ops(ops: object | None, dtype: torch.dtype) -> LoraOps:
    """Float32 on the CPU kernels: `lora_rows` for the decode rows (kernels/csrc/
    lora_rows.cpp), and for runs of a few rows the GEMM that streams w once
    (kernels/csrc/small_gemm.cpp: at a few rows MKL's sgemm spends more on packing its
    operands than on the product, bench/lora.py). Other dtypes: torch."""
    if dtype != torch.float32:
        return LoraOps()
    small = getattr(ops, "small_gemm", None)
    return LoraOps(
        small_mm=torch.mm if small is None else (lambda x, w: small(x, w, None, None)),
        rows=getattr(ops, "lora_rows", None),
    )


@dataclass(frozen=True, slots=True)
class LoraRun:
    start: int
    end: int
    weights: LoraWeights


@dataclass(frozen=True, slots=True)
class LoraBatch:
    runs: tuple[LoraRun, ...]  # prefill rows (and decode rows past STACKED_MAX_ROWS)
    decode: StackedRows | None = None  # the leading decode rows, over every resident adapter
    mm: MatMul = torch.mm  # for the runs (the stacked rows carry their own)

    @classmethod
    def of_rows(
        cls,
        items: list[tuple[int, str, bool]],
        resident: dict[str, LoraWeights],
        stacked: Callable[[], Stacked],
        dtype: torch.dtype,
        ops: LoraOps = LoraOps(),
    ) -> LoraBatch | None:
        """`items`: (number of rows, adapter name or "", is a prefill chunk) per scheduled
        item, in row order (decodes first). None when no row uses an adapter. `ops`: the
        compiled kernels to use (lora_ops)."""
        num_decode = sum(n for n, _, prefill in items if not prefill)
        decode = None
        if 0 < num_decode <= STACKED_MAX_ROWS and any(
            name for _, name, prefill in items if not prefill
        ):
            names = [name for n, name, prefill in items if not prefill for _ in range(n)]
            decode = StackedRows(stacked(), names, dtype, ops.rows)
        runs: list[LoraRun] = []
        row = 0
        for n, name, _ in items:
            if name and (decode is None or row >= decode.n):
                last = runs[-1] if runs else None
                if last is not None and last.end == row and last.weights.config.name == name:
                    runs[-1] = LoraRun(last.start, row + n, last.weights)
                else:
                    runs.append(LoraRun(row, row + n, resident[name]))
            row += n
        if decode is None and not runs:
            return None
        longest = max((r.end - r.start for r in runs), default=0)
        return cls(tuple(runs), decode, ops.small_mm if longest <= STACKED_MAX_ROWS else torch.mm)

    def add(self, layer: int, proj: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += (x[rows] A) B for each row's adapter, in place."""
        if self.decode is not None:
            self.decode.add(layer, proj, x, y)
        for run in self.runs:
            pair = run.weights.layers[layer][proj]
            if pair is not None:
                pair.add(x[run.start : run.end], y[run.start : run.end], self.mm)
