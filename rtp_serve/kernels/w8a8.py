"""W8A8: INT8 weights and INT8 activations, multiplied in integers (`--weight-dtype w8a8`).

Weights are quantized at load, symmetric per output channel (`linear.quantize_int8`, as
weight-only INT8). Activations are quantized as each projection runs, symmetric per row
(`quantize_rows`: a token's scale is its largest |x| / 127). The product of the two is summed
in int32, exactly, and scaled back to float:

    out[m, n] = (float(sum_k xq[m, k] * wq[n, k]) * x_scale[m]) * w_scale[n] (+ bias) (+ res)

Two paths compute the same integer sums, so the GEMM table (rtp_serve/kernels/gemm_table.py)
may pick either per row count: `int8_gemm`, the compiled AVX512-VNNI kernel
(kernels/csrc/int8_gemm.cpp, where the CPU has VNNI), and `int_mm`, torch's own int8 GEMM
(`torch._int_mm`: oneDNN's, which uses VNNI or AMX where the CPU has them). An integer
multiply-add does four times the work of a float32 FMA per instruction on VNNI, and a weight
is one byte: both prefill (compute-bound) and decode (weight-bound) gain over float32, at
the cost of activation rounding that weight-only INT8 does not have (tests/test_precision.py
bounds both against bf16 on a trained model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rtp_serve.kernels.gemm_table import KernelTable
from rtp_serve.kernels.linear import Kernels, TunedLinear, quantize_int8

PANEL = 32  # output columns per int8_gemm panel (two registers of 16 int32 lanes)


def quantize_rows(x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, width] int8, zeros past K; scale [M] float32): x ~= xq * scale[:, None]
    with |xq| <= 127. A row of zeros gets scale 1 (and xq 0)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(xf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    k = x.shape[1]
    if width is not None and width > k:
        q = F.pad(q, (0, width - k))
    return q.contiguous(), scale.contiguous()


def pack_vnni(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 as int8_gemm streams it: [ceil(N / 32), ceil(K / 4), 32, 4], zeros
    padding N and K (kernels/csrc/int8_gemm.cpp draws the layout)."""
    n, k = q.shape
    p, k4 = -(-n // PANEL), -(-k // 4)
    padded = F.pad(q, (0, 4 * k4 - k, 0, PANEL * p - n))
    return padded.view(p, PANEL, k4, 4).transpose(1, 2).contiguous()


class W8A8Linear(TunedLinear):
    """A projection with INT8 weights whose activations are quantized per row as it runs."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype, kernels: Kernels) -> None:
        self.w, self.scale = quantize_int8(w)  # w [out, in] int8, scale [out] float32
        self.dtype = dtype  # activations and output
        self.params = self.w.numel()
        self.nbytes = self.params  # one byte a weight
        self.panels = None  # packed_gemm's: none here
        self.packed_gemm = None
        self._wt = self.w.t()  # [in, out] for torch._int_mm, a view
        self._paths = {}
        ops = kernels.ops
        if ops is not None and getattr(ops, "int8_gemm_supported", lambda: False)():
            self._vnni = pack_vnni(self.w)
            self._sums = self.w.sum(dim=1, dtype=torch.int32)
            self._width = self._vnni.shape[1] * 4
            self._gemm = ops.int8_gemm
            self._paths["int8_gemm"] = self._int8_gemm
        self._paths["int_mm"] = self._int_mm
        first = next(iter(self._paths))
        self.table = KernelTable.split(first, 1 << 30, first)

    def act_dtype(self) -> torch.dtype:
        return self.dtype

    def shape_key(self) -> str:
        n, k = self.w.shape
        return f"W8A8Linear {n}x{k} -> {self.dtype}"

    def _int8_gemm(self, x, bias=None, residual=None):
        xq, xs = quantize_rows(x, self._width)
        out = self._gemm(
            xq, xs, self._vnni, self._sums, self.scale, self.w.shape[0], bias, residual
        )
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _int_mm(self, x, bias=None, residual=None):
        xq, xs = quantize_rows(x)
        out = torch._int_mm(xq, self._wt).float().mul_(xs[:, None]).mul_(self.scale)
        if bias is not None:
            out.add_(bias.float())
        if residual is not None:
            out.add_(residual.float())
        return out if x.dtype == torch.float32 else out.to(x.dtype)
