"""Rotary embedding in the rotate-half layout HF uses (engine/models/llama.py: apply_rope).

    out[..., :D/2] = x1 * cos1 - x2 * sin1      x1 = x[..., :D/2], x2 = x[..., D/2:]
    out[..., D/2:] = x2 * cos2 + x1 * sin2

Each product and the sum are rounded to x's dtype, as the torch ops round them, so in bf16
the result is the reference's bit for bit. One program per token, all its heads.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from rtp_serve.kernels.triton.rounding import cast


@triton.jit
def _rope(
    x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
    H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h < H)[:, None] & (d < HALF)[None, :]
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    lo = cast(x1 * c1, dtype).to(tl.float32) + cast(-x2 * s1, dtype).to(tl.float32)
    hi = cast(x2 * c2[None, :], dtype).to(tl.float32) + cast(x1 * s2[None, :], dtype).to(tl.float32)
    o_row = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(o_row, cast(lo, dtype), mask=mask)
    tl.store(o_row + HALF, cast(hi, dtype), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as engine.models.llama.apply_rope: x [T, H, D], cos/sin [T, 1, D]
    (each token's rows of the tables, in x's dtype) -> a new [T, H, D]."""
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t:
        cos, sin = cos.reshape(t, d), sin.reshape(t, d)
        _rope[(t,)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
            H=h, HALF=d // 2, BLOCK_H=triton.next_power_of_2(h),
            BLOCK_HALF=triton.next_power_of_2(d // 2),
        )  # fmt: skip
    return out
