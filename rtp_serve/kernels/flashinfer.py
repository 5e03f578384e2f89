"""The attention backend over FlashInfer's paged prefill (`pip install flashinfer-python`).

FlashInfer takes the cache as pages [num_blocks, block_size, kv_heads, D] ("NHD": our flat
slots viewed by block) and each sequence's pages in CSR form:

    kv_indptr      [0, p0, p0 + p1, ...]     pages per sequence, cumulated
    kv_indices     the pages themselves, sequence after sequence (each block table's head)
    last_page_len  keys in each sequence's last page (1 .. block_size)

One batch-prefill call covers the whole step: decode rows are sequences of one query
token; with `causal=True` the mask is aligned to the last keys, so row i of a chunk sees
ctx_len + i keys. Any block size works; fp16/bf16 only and no int8 cache (checked by
rtp_serve/kernels/backends.py). The plan is made once per step (the first layer's call).
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

WORKSPACE_BYTES = 128 << 20


class FlashInferAttention:
    def __init__(self, scale: float, device: torch.device) -> None:
        import flashinfer

        self.scale = scale
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._planned: AttentionMetadata | None = None

    def forward(self, q, k, v, cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
        bs = meta.block_size
        write_kv(cache, k, v, meta.slot_mapping, bs)
        if self._planned is not meta:
            self._plan(meta, q, cache)
            self._planned = meta
        pages = (-1, bs, *cache.k.shape[1:])
        return self._wrapper.run(q, (cache.k.view(pages), cache.v.view(pages)))

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, cache: LayerCache) -> None:
        bs = meta.block_size
        seqs = StepSequences.of(meta, q.device)
        pages = (seqs.k_lens + bs - 1) // bs
        used = torch.arange(seqs.block_tables.shape[1], device=q.device)[None, :] < pages[:, None]
        self._wrapper.plan(
            seqs.q_indptr,
            cumulative(pages),
            seqs.block_tables[used],
            seqs.k_lens - (pages - 1) * bs,
            q.shape[1],
            cache.k.shape[1],
            q.shape[2],
            bs,
            causal=True,
            sm_scale=self.scale,
            q_data_type=q.dtype,
            kv_data_type=cache.k.dtype,
        )
