"""The attention backend over the Triton kernels (the AttentionBackend of rtp_serve/kernels/attention.py).

Per layer: the new K/V go into their slots (int8 with in-kernel scales where the cache is
int8), the decode rows attend in one split-K launch, and every prefill chunk of the step in
one varlen launch. The chunks' offsets, lengths and padded block tables are built once per
step (the first layer's call) and reused by the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rtp_serve.kernels.attention import AttentionMetadata, LayerCache
from rtp_serve.kernels.triton import kv_write
from rtp_serve.kernels.triton.paged_decode import paged_decode
from rtp_serve.kernels.triton.paged_prefill import paged_prefill_varlen


@dataclass(frozen=True, slots=True)
class VarlenChunks:
    """A step's prefill chunks as the varlen kernel reads them."""

    q_starts: torch.Tensor  # [chunks] int32
    q_lens: torch.Tensor
    ctx_lens: torch.Tensor
    block_tables: torch.Tensor  # [chunks, max_blocks] int64, padded with block 0
    max_q_len: int

    @classmethod
    def of(cls, meta: AttentionMetadata, device: torch.device) -> VarlenChunks:
        chunks = meta.prefills
        width = max(len(c.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int64, device=device)
        for i, c in enumerate(chunks):
            tables[i, : len(c.block_table)] = c.block_table
        ints = {"dtype": torch.int32, "device": device}
        return cls(
            torch.tensor([c.q_start for c in chunks], **ints),
            torch.tensor([c.q_len for c in chunks], **ints),
            torch.tensor([c.ctx_len for c in chunks], **ints),
            tables,
            max(c.q_len for c in chunks),
        )


class TritonAttention:
    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._step: tuple[AttentionMetadata, VarlenChunks] | None = None

    def forward(self, q, k, v, cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
        bs = meta.block_size
        if cache.k_scale is None or cache.v_scale is None:
            kv_write.write_kv(cache.k, k, meta.slot_mapping)
            kv_write.write_kv(cache.v, v, meta.slot_mapping)
        else:
            kv_write.write_int8(cache.k, cache.k_scale, k, meta.slot_mapping, bs)
            kv_write.write_int8(cache.v, cache.v_scale, v, meta.slot_mapping, bs)
        out = torch.empty_like(q)
        b = meta.num_decodes
        if b:
            out[:b] = paged_decode(
                q[:b], cache.k, cache.v, meta.decode_block_tables, meta.decode_seq_lens,
                bs, self.scale, cache.k_scale, cache.v_scale,
            )  # fmt: skip
        if meta.prefills:
            chunks = self._chunks(meta, q.device)
            paged_prefill_varlen(
                q, out, cache.k, cache.v, chunks.block_tables, chunks.q_starts, chunks.q_lens,
                chunks.ctx_lens, chunks.max_q_len, bs, self.scale, cache.k_scale, cache.v_scale,
            )  # fmt: skip
        return out

    def _chunks(self, meta: AttentionMetadata, device: torch.device) -> VarlenChunks:
        if self._step is None or self._step[0] is not meta:
            self._step = (meta, VarlenChunks.of(meta, device))
        return self._step[1]
