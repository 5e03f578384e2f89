"""CUDA graphs for decode steps: captured once at start for a ladder of batch sizes.

A decode step launches a few hundred small kernels whose launch cost, not their work,
bounds it at small batches. A graph replays them all at once, over the same memory each
time, so a step's inputs are copied into persistent buffers first, and its batch padded up
to the next captured size:

    sizes captured: 1 2 4 8 16 ... 128         a step of 3 decode rows runs graph 4
    buffers:  input_ids  [t0 t1 t2 | 0  ]      rows 0..2 the step's, row 3 padding
              slot       [s0 s1 s2 | X*bs]     padding writes its K/V into the scratch
              tables     [b0 b1 b2 | X X..]    block X (one block the pool never hands
              seq_lens   [l0 l1 l2 | 1  ]      out), reads one key there, and is dropped

Prefill and mixed steps (and steps with LoRA adapters, or more rows than the largest
size) run eagerly. `capture` is how a function becomes replayable: `cuda_capture` on a GPU;
any callable with its contract elsewhere (the tests replay eagerly, on CPU, to check the
bookkeeping).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rtp_serve.kernels.attention import AttentionMetadata

LADDER = (1, 2, 4, 8, 16, 32, 64, 128)

# forward(input_ids, positions, meta, logits_rows) -> logits of those rows
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]
# capture(fn) -> replay: each replay reruns fn's work over the same memory, returns its output
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def padded_size(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds n rows; None past the largest."""
    return next((s for s in sorted(sizes) if s >= n), None)


@dataclass(frozen=True, slots=True)
class DecodeBuffers:
    """The persistent inputs every graph reads, sized for the largest batch."""

    input_ids: torch.Tensor  # [max]
    positions: torch.Tensor  # [max]
    slot_mapping: torch.Tensor  # [max]
    block_tables: torch.Tensor  # [max, max_blocks]
    seq_lens: torch.Tensor  # [max]
    logits_rows: torch.Tensor  # [max]: 0 .. max-1

    @classmethod
    def empty(cls, rows: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(
            zeros(rows),
            zeros(rows),
            zeros(rows),
            zeros(rows, max_blocks),
            zeros(rows),
            torch.arange(rows, device=device),
        )

    def meta(self, size: int, block_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_size=block_size,
            num_decodes=size,
            decode_block_tables=self.block_tables[:size],
            decode_seq_lens=self.seq_lens[:size],
        )


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        sizes: tuple[int, ...],
        max_blocks: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
        capture: Capture,
    ) -> None:
        self.sizes = tuple(sorted(set(sizes)))
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.buffers = DecodeBuffers.empty(self.sizes[-1], max_blocks, device)
        self._pad_rows()  # what the padding rows hold while capturing, too
        self._replay: dict[int, Callable[[], torch.Tensor]] = {}
        b = self.buffers
        for size in reversed(self.sizes):  # largest first: smaller ones reuse its memory
            meta = b.meta(size, block_size)

            def step(size=size, meta=meta) -> torch.Tensor:
                return forward(b.input_ids[:size], b.positions[:size], meta, b.logits_rows[:size])

            self._replay[size] = capture(step)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Logits of every row of a decode-only step, or None if no graph fits it. They live
        in the graphs' memory: read them before the next step."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        if size is None or meta.prefills or meta.num_decodes != n:
            return None
        b = self.buffers
        b.input_ids[:n] = input_ids
        b.positions[:n] = positions
        b.slot_mapping[:n] = meta.slot_mapping
        tables = meta.decode_block_tables
        b.block_tables[:n, : tables.shape[1]] = tables
        b.block_tables[:n, tables.shape[1] :] = self.scratch_block
        b.seq_lens[:n] = meta.decode_seq_lens
        self._pad_rows(n)
        return self._replay[size]()[:n]

    def _pad_rows(self, start: int = 0) -> None:
        b = self.buffers
        b.input_ids[start:] = 0
        b.positions[start:] = 0
        b.slot_mapping[start:] = self.scratch_block * self.block_size
        b.block_tables[start:] = self.scratch_block
        b.seq_lens[start:] = 1


def cuda_capture(device: torch.device) -> Capture:
    """Capture on `device`, every graph in one memory pool (they never run at once)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # Warm up on a side stream first, as torch.cuda.graphs asks (lazy init, autotuning).
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture
