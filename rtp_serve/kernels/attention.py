"""Paged attention: the interface the engine calls, and its torch reference implementation.

KV for one layer lives in two flat tensors of slots, [num_blocks * block_size, kv_heads, D];
token t of a request sits in slot `block_table[t // block_size] * block_size + t % block_size`.

A step's new tokens come as one flat batch, decodes first:

    tokens:  | d0 | d1 | ... | d(B-1) | p0 p0 p0 p0 | p1 p1 | ...
               one token per decode     prefill chunks (any length), each
               sequence, any context    after `ctx_len` tokens already cached

The cache may be stored in a narrower dtype than the model computes in (bf16 KV for float32
weights, or int8 with a scale per block and kv head: rtp_serve/kernels/kv_quant.py): writes round to
it, reads widen from it. Every layer writes the new K/V into their slots first, then
attends, so a block computed in this step can already be read by another sequence of the
same step. Over a narrower cache a prompt attends to its own K/V as stored too: the values
a later prefix hit reads. `CpuKernelAttention` (the compiled CPU kernels, reading the blocks
in place) implements the same interface, as do the GPU backends (kernels/triton/backend.py,
rtp_serve/kernels/flash_attn.py, rtp_serve/kernels/flashinfer.py); rtp_serve/kernels/backends.py chooses among them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from rtp_serve.kernels import kv_quant


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    q_start: int  # offset of its first new token in the flat batch
    q_len: int
    ctx_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [blocks] int64: the blocks of all ctx_len + q_len tokens


@dataclass(frozen=True, slots=True)
class LayerCache:
    """One layer's KV slots, [num_blocks * block_size, kv_heads, D] each; an int8 cache also
    has a float32 scale per block and kv head, [num_blocks, kv_heads] each."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def gather(
        self, slots: torch.Tensor, block_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these slots (any shape), widened to `dtype`: [*slots.shape, Hkv, D]."""
        k, v = _gather(self.k, slots), _gather(self.v, slots)
        if self.k_scale is None or self.v_scale is None:
            return k.to(dtype), v.to(dtype)
        blocks = slots // block_size
        return (
            kv_quant.dequantize(k, self.k_scale[blocks], dtype),
            kv_quant.dequantize(v, self.v_scale[blocks], dtype),
        )


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
        cache: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]; writes k/v into the cache."""
        ...


def write_kv(
    cache: LayerCache,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    write_int8=kv_quant.write_int8,
    write_float=None,
) -> None:
    """k/v [T, Hkv, D] into the cache at `slot_mapping`. `write_float`: a kernel that writes
    both into a float cache at once, as the compiled `kv_write` (else torch's index_copy_)."""
    if cache.k_scale is None or cache.v_scale is None:
        if write_float is not None:
            write_float(cache.k, cache.v, k, v, slot_mapping)
            return
        cache.k.index_copy_(0, slot_mapping, k.to(cache.k.dtype))
        cache.v.index_copy_(0, slot_mapping, v.to(cache.v.dtype))
    else:
        write_int8(cache.k, cache.k_scale, k, slot_mapping, block_size)
        write_int8(cache.v, cache.v_scale, v, slot_mapping, block_size)


class TorchAttention:
    """Reference backend on plain torch ops (CPU or any device)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        # A subclass swaps in kernels with these signatures.
        self._paged_decode = paged_decode
        self._write_int8 = kv_quant.write_int8
        self._write_float = None

    def forward(self, q, k, v, cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(
            cache, k, v, meta.slot_mapping, meta.block_size, self._write_int8, self._write_float
        )
        out = torch.empty_like(q)
        b = meta.num_decodes
        if b:
            out[:b] = self.decode(q[:b], cache, meta)
        for chunk in meta.prefills:
            sl = slice(chunk.q_start, chunk.q_start + chunk.q_len)
            out[sl] = self.prefill(q[sl], k[sl], v[sl], cache, chunk, meta.block_size)
        return out

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerCache,
        chunk: PrefillChunk,
        block_size: int,
    ) -> torch.Tensor:
        """One chunk's attention; its k/v are already in the cache."""
        as_stored = cache.k.dtype != q.dtype  # read back what the cache holds (see above)
        if chunk.ctx_len == 0 and not as_stored:
            return _attend(q, k, v, None, self.scale, causal=True)
        return paged_prefill(q, cache, chunk.block_table, chunk.ctx_len, block_size, self.scale)

    def decode(self, q, cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
        return self._paged_decode(
            q,
            cache.k,
            cache.v,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            meta.block_size,
            self.scale,
            cache.k_scale,
            cache.v_scale,
        )


class CpuKernelAttention(TorchAttention):
    """Decode and K/V writes through the compiled CPU kernels (K/V read in place), and
    prefill too where `compiled_prefill`.

    The compiled `paged_prefill` reads the blocks in place; the reference gathers them (or,
    for a prompt with nothing cached, runs SDPA's causal flash kernel on the new K/V). On
    AVX-512 (an EPYC with AVX512-BF16; bench/attention.py, 12 query and 4 kv heads) the
    kernel ran at 2.5x the reference's speed for a new 200-token prompt (bf16 2.8x),
    1.46x (1.61x) at 1,024 tokens, 1.18x (1.40x) at 2,048, and 1.4-1.8x for 256 tokens
    after a cached prefix of 1,024 (float32, bf16 and int8 KV).
    The AVX2 build ran at 0.73-1.06x of the reference on the same EPYC (RTP_SERVE_ISA=avx2,
    12 heads; the reference's torch kept its AVX-512 code) and at 0.6-0.9x in an older
    version on an AVX2-only EPYC: AVX2 keeps the reference (rtp_serve/kernels/backends.py
    turns the kernel on from the AVX-512 level).
    """

    def __init__(self, scale: float, ops, compiled_prefill: bool = False) -> None:
        super().__init__(scale)
        self.ops = ops
        self.compiled_prefill = compiled_prefill
        self._paged_decode = ops.paged_decode
        self._write_int8 = ops.kv_write_int8
        self._write_float = ops.kv_write

    def prefill(self, q, k, v, cache: LayerCache, chunk: PrefillChunk, block_size: int):
        if not self.compiled_prefill:
            return super().prefill(q, k, v, cache, chunk, block_size)
        return self.ops.paged_prefill(
            q, cache.k, cache.v, chunk.block_table, chunk.ctx_len, block_size, self.scale,
            cache.k_scale, cache.v_scale,
        )  # fmt: skip


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence against its whole cached context. q [B, Hq, D]."""
    lmax = int(seq_lens.max())
    offsets = torch.arange(block_size, device=q.device)
    slots = (block_tables[:, :, None] * block_size + offsets).flatten(1)[:, :lmax]
    cache = LayerCache(k_cache, v_cache, k_scale, v_scale)
    keys, values = cache.gather(slots, block_size, q.dtype)  # [B, Lmax, Hkv, D]
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
    cache: LayerCache,
    block_table: torch.Tensor,
    ctx_len: int,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """New tokens attend to `ctx_len` cached tokens plus themselves (causally), all read from
    the cache through the sequence's block table. q [n, Hq, D]."""
    n = q.shape[0]
    offsets = torch.arange(block_size, device=q.device)
    slots = (block_table[:, None] * block_size + offsets).flatten()[: ctx_len + n]
    # [ctx_len + n, Hkv, D], widened to the query's dtype if the cache is stored narrower
    keys, values = cache.gather(slots, block_size, q.dtype)
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


@dataclass(frozen=True, slots=True)
class StepSequences:
    """A step as the library backends take it (flash-attn, FlashInfer): every decode row and
    prefill chunk one sequence of `q_lens` new tokens over `k_lens` keys (those included)."""

    q_lens: torch.Tensor  # [S] int32
    q_indptr: torch.Tensor  # [S + 1] int32: where each sequence's rows start
    k_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0

    @classmethod
    def of(cls, meta: AttentionMetadata, device: torch.device) -> StepSequences:
        b = meta.num_decodes
        tables = [] if not b else list(meta.decode_block_tables)
        tables += [c.block_table for c in meta.prefills]
        padded = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32, device=device)
        for i, t in enumerate(tables):
            padded[i, : len(t)] = t
        q_lens = torch.tensor([1] * b + [c.q_len for c in meta.prefills], device=device)
        k_lens = torch.tensor([c.ctx_len + c.q_len for c in meta.prefills], device=device)
        if b:
            k_lens = torch.cat([meta.decode_seq_lens.to(device), k_lens])
        q_lens = q_lens.int()
        return cls(q_lens, cumulative(q_lens), k_lens.int(), padded)


def cumulative(lens: torch.Tensor) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] in int32: the offsets CSR-style kernels take."""
    return F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
