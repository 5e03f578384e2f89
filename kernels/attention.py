"""Paged attention: the interface the engine calls, and its torch reference implementation.

KV for one layer lives in two flat tensors of slots, [num_blocks * block_size, kv_heads, D];
token t of a request sits in slot `block_table[t // block_size] * block_size + t % block_size`.

A step's new tokens come as one flat batch, decodes first:

    tokens:  | d0 | d1 | ... | d(B-1) | p0 p0 p0 p0 | p1 p1 | ...
               one token per decode     prefill chunks (any length), each
               sequence, any context    after `ctx_len` tokens already cached

The cache may be stored in a narrower dtype than the model computes in (bf16 KV for float32
weights): writes round to it, reads widen from it. Every layer writes the new K/V into their
slots first, then attends, so a block computed
in this step can already be read by another sequence of the same step.
`CpuKernelAttention` (decode through the compiled CPU kernel) implements the same interface;
a GPU backend would too (none exists yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    q_start: int  # offset of its first new token in the flat batch
    q_len: int
    ctx_len: int  # tokens already in the cache before this chunk
    # Slots of all ctx_len + q_len tokens; None when ctx_len == 0 (attend to new K/V only).
    slots: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token
    block_size: int
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] int64, padded
    decode_seq_lens: torch.Tensor | None = None  # [B] context length incl. the new token
    prefills: list[PrefillChunk] = field(default_factory=list)


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], caches [S, Hkv, D] -> out [T, Hq, D]."""
        ...


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class TorchAttention:
    """Reference backend on plain torch ops (CPU or any device)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._paged_decode = paged_decode  # a subclass swaps in a kernel with this signature

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        b = meta.num_decodes
        if b:
            out[:b] = self.decode(q[:b], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            sl = slice(chunk.q_start, chunk.q_start + chunk.q_len)
            if chunk.slots is None:
                out[sl] = _attend(q[sl], k[sl], v[sl], None, self.scale, causal=True)
            else:
                out[sl] = paged_prefill(
                    q[sl], k_cache, v_cache, chunk.slots, chunk.ctx_len, self.scale
                )
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self._paged_decode(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            meta.block_size,
            self.scale,
        )


class CpuKernelAttention(TorchAttention):
    """Decode through the compiled CPU kernel (reads K/V in place); prefill as the reference."""

    def __init__(self, scale: float, ops) -> None:
        super().__init__(scale)
        self.ops = ops
        self._paged_decode = ops.paged_decode


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its whole cached context. q [B, Hq, D]."""
    lmax = int(seq_lens.max())
    offsets = torch.arange(block_size, device=q.device)
    slots = (block_tables[:, :, None] * block_size + offsets).flatten(1)[:, :lmax]
    keys = _gather(k_cache, slots).to(q.dtype)  # [B, Lmax, Hkv, D]
    values = _gather(v_cache, slots).to(q.dtype)
    mask = None  # all the same length needs no mask
    if int(seq_lens.min()) < lmax:
        valid = torch.arange(lmax, device=q.device)[None, :] < seq_lens[:, None]
        # Padding slots hold whatever memory had (even NaN): zero them, not just mask them.
        keys = keys.masked_fill(~valid[:, :, None, None], 0.0)
        values = values.masked_fill(~valid[:, :, None, None], 0.0)
        mask = valid[:, None, None, :]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, Lmax, D]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    ctx_len: int,
    scale: float,
) -> torch.Tensor:
    """New tokens attend to `ctx_len` cached tokens plus themselves (causally). q [n, Hq, D]."""
    n = q.shape[0]
    # [ctx_len + n, Hkv, D], widened to the query's dtype if the cache is stored narrower
    keys, values = _gather(k_cache, slots).to(q.dtype), _gather(v_cache, slots).to(q.dtype)
    # Query i sits at position ctx_len + i and sees keys 0 .. ctx_len + i.
    mask = torch.ones(n, ctx_len + n, dtype=torch.bool, device=q.device).tril(diagonal=ctx_len)
    return _attend(q, keys, values, mask, scale, causal=False)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # index_select on the flat slot axis is several times faster than advanced indexing.
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def _attend(q, k, v, mask, scale: float, causal: bool) -> torch.Tensor:
    # [n, H, D] -> [1, H, n, D] for SDPA, and back.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def get_attention_backend(device: torch.device, scale: float) -> AttentionBackend:
    """The backend for a device: the compiled CPU kernel where it builds, else torch ops
    (also on CUDA until the GPU kernels land)."""
    if device.type == "cpu":
        from kernels import cpu

        ops = cpu.load()
        if ops is not None:
            return CpuKernelAttention(scale, ops)
    return TorchAttention(scale)
