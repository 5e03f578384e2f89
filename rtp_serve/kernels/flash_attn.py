"""The attention backend over flash-attn's paged KV (`pip install flash-attn`, CUDA only).

flash-attn reads the cache as [num_blocks, block_size, kv_heads, D] pages, which is our
flat slot layout viewed by block, through a block table per sequence. One varlen call
covers the whole step: decode rows are sequences of one query token, prefill chunks of
`q_len`; with `causal=True` and more keys than queries the mask is aligned bottom-right,
which is exactly "row i sees ctx_len + i keys". Its constraints (fp16/bf16 only, no int8
cache, pages a multiple of 256 tokens) are checked by rtp_serve/kernels/backends.py before choosing it.
"""

from __future__ import annotations

import torch

from rtp_serve.kernels.attention import (
    AttentionMetadata,
    LayerCache,
    StepSequences,
    cumulative,
    write_kv,
)


class FlashAttention:
    def __init__(self, scale: float) -> None:
        from flash_attn import flash_attn_varlen_func

        self.scale = scale
        self._varlen = flash_attn_varlen_func

    def forward(self, q, k, v, cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
        bs = meta.block_size
        write_kv(cache, k, v, meta.slot_mapping, bs)
        seqs = StepSequences.of(meta, q.device)
        pages = (-1, bs, *cache.k.shape[1:])
        return self._varlen(
            q,
            cache.k.view(pages),
            cache.v.view(pages),
            cu_seqlens_q=seqs.q_indptr,
            cu_seqlens_k=cumulative(seqs.k_lens),
            max_seqlen_q=int(seqs.q_lens.max()),
            max_seqlen_k=int(seqs.k_lens.max()),
            softmax_scale=self.scale,
            causal=True,
            block_table=seqs.block_tables,
        )
