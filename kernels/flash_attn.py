"""The attention backend over flash-attn's paged KV (`pip install flash-attn`, CUDA only).

flash-attn reads the cache as [num_blocks, block_size, kv_heads, D] pages, which is our
flat slot layout viewed by block, through a block table per sequence. One varlen call
covers the whole step: decode rows are sequences of one query token, prefill chunks of
`q_len`; with `causal=True` and more keys than queries the mask is aligned bottom-right,
which is exactly "row i sees ctx_len + i keys". Its constraints (fp16/bf16 only, no int8
cache, pages a multiple of 256 tokens) are checked by kernels/backends.py before choosing it.
"""

from __future__ import annotations

import torch

from kernels.attention import AttentionMetadata, LayerCache, write_kv


class FlashAttention:
    def __init__(self, scale: float) -> None:
        from flash_attn import flash_attn_varlen_func

        self.scale = scale
        self._varlen = flash_attn_varlen_func

    def forward(self, q, k, v, cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
        bs = meta.block_size
        write_kv(cache, k, v, meta.slot_mapping, bs)
        q_lens, k_lens, tables = _sequences(meta, q.device)
        pages = (-1, bs, *cache.k.shape[1:])
        return self._varlen(
            q,
            cache.k.view(pages),
            cache.v.view(pages),
            cu_seqlens_q=_cumulative(q_lens),
            cu_seqlens_k=_cumulative(k_lens),
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(k_lens.max()),
            softmax_scale=self.scale,
            causal=True,
            block_table=tables,
        )


def _sequences(meta: AttentionMetadata, device: torch.device):
    """Per sequence of the step (decodes, then chunks): query and key counts, block tables."""
    b = meta.num_decodes
    q_lens = [1] * b + [c.q_len for c in meta.prefills]
    tables = [] if not b else list(meta.decode_block_tables)
    tables += [c.block_table for c in meta.prefills]
    width = max(len(t) for t in tables)
    padded = torch.zeros(len(tables), width, dtype=torch.int32, device=device)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    k_lens = torch.tensor([c.ctx_len + c.q_len for c in meta.prefills], device=device)
    if b:
        k_lens = torch.cat([meta.decode_seq_lens.to(device), k_lens])
    return torch.tensor(q_lens, device=device, dtype=torch.int32), k_lens.int(), padded


def _cumulative(lens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
