"""The attention backend over flash-attn's paged KV (`pip install flash-attn`, CUDA only).

flash-attn reads the cache as [num_blocks, block_size, kv_heads, D] pages, which is our
flat slot layout viewed by block, through a block table per sequence. One varlen call
covers the whole step: decode rows are sequences of one query token, prefill chunks of
`q_len`; with `causal=True` and more keys than queries the mask is aligned bottom-right,
which is exactly "row i sees ctx_len + i keys". Its constraints (fp16/bf16 only, no int8
cache, pages a multiple of 256 tokens) are checked by rtp_serve/kernels/backends.py before choosing it.

The call's tables (offsets, block tables, the longest query and key run) are the same for
every layer of a step: built once, by the step's first layer (`StepTables`), with one
device-to-host copy for the two maxima.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rtp_serve.kernels.attention import (
    AttentionMetadata,
    LayerCache,
    StepSequences,
    cumulative,
    write_kv,
)


@dataclass(frozen=True, slots=True)
class FlashTables:
    """flash_attn_varlen_func's view of one step."""

    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    cu_seqlens_k: torch.Tensor  # [S + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [S, max_blocks] int32

    @classmethod
    def of(cls, meta: AttentionMetadata, device: torch.device) -> FlashTables:
        seqs = StepSequences.of(meta, device)
        # Both maxima in one device-to-host copy: the one sync of the step.
        max_q, max_k = torch.stack([seqs.q_lens.max(), seqs.k_lens.max()]).tolist()
        return cls(seqs.q_indptr, cumulative(seqs.k_lens), max_q, max_k, seqs.block_tables)


class StepTables:
    """The tables of the step last seen. The model hands every layer of a step the same
    AttentionMetadata, so its first layer builds them and the others reuse them (holding
    `meta` keeps its identity from being reused by a later step's). CUDA graphs, which keep
    one metadata over steps and change its tensors in place, run only with Triton."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._tables: FlashTables | None = None

    def get(self, meta: AttentionMetadata, device: torch.device) -> FlashTables:
        if self._meta is not meta or self._tables is None:
            self._tables = FlashTables.of(meta, device)
            self._meta = meta
        return self._tables


class FlashAttention:
    def __init__(self, scale: float) -> None:
        from flash_attn import flash_attn_varlen_func

        self.scale = scale
        self._varlen = flash_attn_varlen_func
        self._tables = StepTables()

    def forward(self, q, k, v, cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
        bs = meta.block_size
        write_kv(cache, k, v, meta.slot_mapping, bs)
        t = self._tables.get(meta, q.device)
        pages = (-1, bs, *cache.k.shape[1:])
        return self._varlen(
            q,
            cache.k.view(pages),
            cache.v.view(pages),
            cu_seqlens_q=t.cu_seqlens_q,
            cu_seqlens_k=t.cu_seqlens_k,
            max_seqlen_q=t.max_seqlen_q,
            max_seqlen_k=t.max_seqlen_k,
            softmax_scale=self.scale,
            causal=True,
            block_table=t.block_table,
        )
