"""Paged decode attention: one query token per sequence against its whole cached context.

Two launches. The first splits each sequence's context into `splits` ranges and runs one
program per (sequence, kv head, range): the group's query heads (GQA) share every K/V tile
it loads, and it writes a partial output with its log-sum-exp. The second merges the
ranges per (sequence, query head):

    context of sequence b:  | range 0 | range 1 | ... | range S-1 |   (ranges past the end
    partials:                 o_0,lse_0  o_1,lse_1       o_S-1,lse_S-1  are empty: lse -inf)
    out = sum_s exp(lse_s - max lse) * o_s / sum_s exp(lse_s - max lse)

Splitting keeps the GPU busy when the batch is small and the contexts long (split-K, as in
flash-decoding). The grid depends only on the batch size and `splits`, never on the
sequence lengths, so a step is capturable in a CUDA graph: no host sync.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from rtp_serve.kernels.triton.rounding import cast

BLOCK_N = 32  # keys per tile
MAX_SPLITS = 16


def num_splits(batch: int, kv_heads: int, target_programs: int = 256) -> int:
    """Ranges per sequence: enough programs to fill a large GPU at small batches, one
    range when the batch alone does."""
    return max(1, min(MAX_SPLITS, target_programs // max(1, batch * kv_heads)))


@triton.jit
def _decode_ranges(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, part_o_ptr, part_lse_ptr,
    scale, block_size,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_ss, stride_tb,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    h = tl.arange(0, BLOCK_H)
    h_mask = h < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    heads = kvh * GROUP + h
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < hi
        block = tl.load(tables_ptr + b * stride_tb + t // block_size, mask=t_mask, other=0)
        slot = block.to(tl.int64) * block_size + t % block_size
        kv_off = slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        if QUANT:  # int8 rows times their block's scale, as they are read
            s_off = block * stride_ss + kvh
            k = k * tl.load(ks_ptr + s_off, mask=t_mask, other=0.0)[:, None]
            v = v * tl.load(vs_ptr + s_off, mask=t_mask, other=0.0)[:, None]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    filled = l > 0
    out = acc / tl.where(filled, l, 1.0)[:, None]
    lse = tl.where(filled, m + tl.log(tl.where(filled, l, 1.0)), float("-inf"))
    part = (b * GROUP * tl.num_programs(1) + heads) * SPLITS + split  # [B, Hq, SPLITS]
    tl.store(part_lse_ptr + part, lse, mask=h_mask)
    tl.store(
        part_o_ptr + part[:, None] * D + d[None, :], out, mask=h_mask[:, None] & d_mask[None, :]
    )


@triton.jit
def _merge_ranges(
    part_o_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_heads,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    row = (b * num_heads + h) * SPLITS
    lse = tl.load(part_lse_ptr + row + s, mask=s_mask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # an empty range weighs exp(-inf) = 0
    o = tl.load(
        part_o_ptr + (row + s)[:, None] * D + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        cast(out, out_ptr.dtype.element_ty),
        mask=d_mask,
    )


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
    splits: int | None = None,
) -> torch.Tensor:
    """Same contract as kernels.attention.paged_decode: q [B, Hq, D] -> [B, Hq, D]."""
    batch, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    splits = splits or num_splits(batch, hkv)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    part_o = torch.empty(batch, hq, splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, hq, splits, dtype=torch.float32, device=q.device)
    quant = k_scale is not None
    ks = k_scale if quant else k_cache  # unused without QUANT
    vs = v_scale if quant else v_cache
    block_d = triton.next_power_of_2(d)
    _decode_ranges[(batch, hkv, splits)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, part_o, part_lse,
        scale, block_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        ks.stride(0) if quant else 0, block_tables.stride(0),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=d, BLOCK_D=max(16, block_d),
        BLOCK_N=BLOCK_N, SPLITS=splits, QUANT=quant, PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    _merge_ranges[(batch, hq)](
        part_o, part_lse, out, out.stride(0), out.stride(1), hq,
        D=d, BLOCK_D=block_d, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
    )  # fmt: skip
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for a model dtype."""
    # float32 models get IEEE dot products (TF32 would cost them parity with the reference);
    # bf16/fp16 values are exact in TF32's 10-bit mantissa, so their dots lose nothing.
    return "ieee" if dtype == torch.float32 else "tf32"
