"""Paged prefill attention: a varlen batch of chunks, each after its cached prefix.

Chunk c has `q_lens[c]` new tokens at rows `q_starts[c]` .. of the flat batch, after
`ctx_lens[c]` tokens already cached; its K/V (prefix and new, written before this runs)
are read through its row of `block_tables`. One program per (chunk, tile of BLOCK_M new
tokens, query head) runs flash attention's online softmax over the keys that tile can see:

    keys:   0 ............ ctx_len ............ ctx_len + q_len
            |  cached prefix  |   new tokens (causal)   |
    row i of the chunk sees keys 0 .. ctx_len + i

The grid is (chunks, tiles of the longest chunk, heads); the tiles past a shorter chunk's
end have no rows and store nothing.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from rtp_serve.kernels.triton.paged_decode import dot_precision
from rtp_serve.kernels.triton.rounding import cast

BLOCK_M = 16
BLOCK_N = 32


@triton.jit
def _prefill(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tables_ptr, q_starts_ptr, q_lens_ptr,
    ctx_lens_ptr, scale, block_size,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_ss, stride_tb,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(q_starts_ptr + c)
    q_len = tl.load(q_lens_ptr + c)
    ctx_len = tl.load(ctx_lens_ptr + c)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    # The tile's last row sees keys up to ctx_len + its index; a tile with no rows, none.
    last = tl.minimum(tile * BLOCK_M + BLOCK_M, q_len)
    k_end = tl.where(last > tile * BLOCK_M, ctx_len + last, 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, k_end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < k_end
        block = tl.load(tables_ptr + c * stride_tb + t // block_size, mask=t_mask, other=0)
        slot = block.to(tl.int64) * block_size + t % block_size
        kv_off = slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        if QUANT:
            s_off = block * stride_ss + kvh
            k = k * tl.load(ks_ptr + s_off, mask=t_mask, other=0.0)[:, None]
            v = v * tl.load(vs_ptr + s_off, mask=t_mask, other=0.0)[:, None]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = t_mask[None, :] & (t[None, :] <= ctx_len + rows[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # Key 0 is in the first tile and visible to every row, so m is finite from then on.
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
        cast(out, out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_varlen(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_q_len: int,
    block_size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Attend every chunk's new rows of q [T, Hq, D] into the same rows of `out`.
    block_tables [chunks, max_blocks] (padded), q_starts/q_lens/ctx_lens [chunks]."""
    chunks = q_lens.shape[0]
    hq, d = q.shape[1], q.shape[2]
    if chunks == 0 or max_q_len == 0:
        return
    quant = k_scale is not None
    ks = k_scale if quant else k_cache  # unused without QUANT
    vs = v_scale if quant else v_cache
    grid = (chunks, triton.cdiv(max_q_len, BLOCK_M), hq)
    _prefill[grid](
        q, k_cache, v_cache, ks, vs, out, block_tables, q_starts, q_lens, ctx_lens,
        scale, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), ks.stride(0) if quant else 0,
        block_tables.stride(0),
        GROUP=hq // k_cache.shape[1], D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, QUANT=quant, PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
