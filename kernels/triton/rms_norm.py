"""RMSNorm over the last dim, optionally fused with the residual add before it.

    rms_norm(x, w, eps)               -> w * normalize(x)
    rms_norm(x, w, eps, residual=r)   -> (w * normalize(x + r), x + r)

One program per row. The rounding is HF's (engine/models/llama.py: rms_norm): the sum x + r
is rounded to the model dtype (it is the next residual), normalized in float32, rounded to
the dtype, then scaled by the weight in the dtype.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from rtp_serve.kernels.triton.rounding import cast


@triton.jit
def _rms_norm(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, eps, stride_x, stride_r, stride_o,
    N: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = cast(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(r_out_ptr + row * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = cast(xf * rstd, x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, cast(w * normed, out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] (rows contiguous); with `residual` [T, N], also returns x + residual."""
    t, n = x.shape
    out = torch.empty_like(x)
    r_out = torch.empty_like(x) if residual is not None else out
    if t:
        r = residual if residual is not None else x
        _rms_norm[(t,)](
            x, r, weight, out, r_out, eps, x.stride(0), r.stride(0), out.stride(0),
            N=n, BLOCK=triton.next_power_of_2(n), RESIDUAL=residual is not None,
        )  # fmt: skip
    return out if residual is None else (out, r_out)
