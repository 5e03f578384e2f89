"""New K/V rows into their cache slots: a plain copy, or int8 with adaptive block scales.

`write_kv` copies rows [T, H, D] into the cache [S, H, D] at `slot_mapping`, converting to
the cache's dtype. `write_int8` does what rtp_serve/kernels/kv_quant.py's reference does, per (run
of consecutive tokens in one block, kv head): one program per (token, kv head), of which
only those starting a run work:

    slot_mapping // block_size:   7 7 7 | 3 | 9 9     runs start at tokens 0, 3, 4
    program (token 0, head h):    amax of rows 0..2 -> scale of block 7 (grown? requantize
                                  the block's rows first) -> quantize rows 0..2

The tokens of one block are contiguous and in position order (as a step lays them out),
so no two programs touch the same block and head. Each token is stored at its own slot, as
the reference does: CUDA-graph padding rows repeat one scratch slot (engine/cuda_graphs.py),
and a run of them is longer than a block.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from rtp_serve.kernels.triton.rounding import cast

# A jit function reads module globals only as constexprs: compiled Triton refuses a plain
# float (the CPU interpreter the tests run under allows it; found on the first GPU run).
QMAX = tl.constexpr(127.0)


@triton.jit
def _copy_rows(
    x_ptr, cache_ptr, slots_ptr, stride_xt, stride_xh, stride_cs, stride_ch,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < H)[:, None] & (d < D)[None, :]
    row = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask)
    dst = cache_ptr + slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(dst, cast(row, cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_half_even(y):
    # torch.round's rounding, in plain arithmetic (the interpreter has no rint): ties go to
    # the even neighbour. Exact for the |y| <= a few hundred it is used on.
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _write_int8(
    x_ptr, cache_ptr, scales_ptr, slots_ptr, num_tokens, block_size,
    stride_xt, stride_xh, stride_cs, stride_ch, stride_ss,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    block = slot // block_size
    prev = tl.load(slots_ptr + t - 1, mask=t > 0, other=-1)
    starts_run = (prev < 0) | (prev // block_size != block)  # prev -1: t is token 0
    if starts_run:
        d = tl.arange(0, BLOCK_D)
        d_mask = d < D
        # The run: tokens t .. t + n - 1 all in `block`.
        n = 1
        nxt = tl.load(slots_ptr + t + 1, mask=t + 1 < num_tokens, other=-1)
        while (nxt >= 0) & (nxt // block_size == block):
            n += 1
            nxt = tl.load(slots_ptr + t + n, mask=t + n < num_tokens, other=-1)
        amax = 0.0
        for i in range(n):
            row = tl.load(x_ptr + (t + i) * stride_xt + h * stride_xh + d, mask=d_mask, other=0)
            amax = tl.maximum(amax, tl.max(tl.abs(row.to(tl.float32)), 0))
        s_ptr = scales_ptr + block * stride_ss + h
        # A run starting at offset 0 starts a fresh block: its old scale is never read.
        old = tl.where(slot % block_size > 0, tl.load(s_ptr), 0.0)
        new = tl.maximum(old, amax * (1.0 / QMAX))
        base = cache_ptr + (block * block_size).to(tl.int64) * stride_cs + h * stride_ch
        if (old > 0) & (new > old):  # the scale grew: earlier rows move to the new steps
            ratio = old / new
            r = tl.arange(0, BLOCK_R)
            held_ptr = base + r[:, None] * stride_cs + d[None, :]
            held_mask = (r < block_size)[:, None] & d_mask[None, :]
            held = tl.load(held_ptr, mask=held_mask, other=0).to(tl.float32)
            requant = tl.clamp(_round_half_even(held * ratio), -QMAX, QMAX)
            tl.store(held_ptr, requant.to(tl.int8), mask=held_mask)
        tl.store(s_ptr, new)
        inv = tl.where(new > 0, 1.0 / new, 0.0)
        for i in range(n):
            x = tl.load(x_ptr + (t + i) * stride_xt + h * stride_xh + d, mask=d_mask, other=0)
            q = tl.clamp(_round_half_even(x.to(tl.float32) * inv), -QMAX, QMAX)
            # Each token to its own slot, not `slot + i`: a run may repeat a slot (CUDA-graph
            # padding rows all share one scratch slot) and must never step past its block.
            own = tl.load(slots_ptr + t + i).to(tl.int64)
            dst = cache_ptr + own * stride_cs + h * stride_ch + d
            tl.store(dst, q.to(tl.int8), mask=d_mask)


def write_kv(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache[slot_mapping[t]] = x[t] (in the cache's dtype); x [T, H, D]."""
    t, h, d = x.shape
    if t == 0:
        return
    _copy_rows[(t,)](
        x, cache, slot_mapping, x.stride(0), x.stride(1), cache.stride(0), cache.stride(1),
        H=h, D=d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip


def write_int8(
    cache: torch.Tensor,
    scales: torch.Tensor,
    x: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """Same contract as kernels.kv_quant.write_int8."""
    t, h, d = x.shape
    if t == 0:
        return
    _write_int8[(t, h)](
        x, cache, scales, slot_mapping, t, block_size,
        x.stride(0), x.stride(1), cache.stride(0), cache.stride(1), scales.stride(0),
        D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_R=triton.next_power_of_2(block_size),
    )  # fmt: skip
