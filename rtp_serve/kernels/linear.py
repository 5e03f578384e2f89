"""Projections: a weight prepared once at load for the CPU it runs on, called per step.

`make_linear(w, ...)` takes a checkpoint weight [out, in] and returns a `LinearOp`, which
computes `(residual +) x @ w.T (+ bias)` for x [T, in] in the model's dtype. Which kernel
runs depends on the weight's storage, the number of rows and the CPU (rtp_serve/kernels/isa.py):

    storage          T <= SMALL_M (decode: memory-bound)       more rows (prefill: compute-bound)
    float32 [o,i]    rows_gemm (streams fp32 weights)           MKL sgemm
    bf16/fp16 [o,i]  rows_gemm (widens to fp32 as it streams)   avx512_bf16+: oneDNN prepacked
                                                                else: widen, MKL sgemm
    int8 [out, in]   rows_gemm (x * q, then * scale per out)    dequantize, then as above
    + scale [out]

On CPUs with native bf16 dot products (avx512_bf16, AMX), bf16 activations over bf16 weights
take oneDNN's prepacked GEMM from PACKED_FROM rows on: it beats widening to float32 there.

Every weight keeps the checkpoint's [out, in] layout, so one already in the dtype it runs in
is used where the loader put it (a view of the mapped file: engine/weights.py), never
copied. The compiled kernels accumulate in float32 whatever the storage. Weight-only INT8 is
symmetric per output channel, quantized at load from the checkpoint (`quantize_int8`); it
halves bf16's weight bytes, which is what bounds decode. Without compiled kernels
(RTP_SERVE_ISA=scalar) every op is the torch reference, which is also what tests compare to.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from rtp_serve.kernels.isa import CpuIsa

log = logging.getLogger(__name__)

SMALL_M = 32  # up to this many rows a projection is memory-bound on the CPUs measured
# bf16 with oneDNN's prepacked GEMM (avx512_bf16+): from this many rows it is faster than
# rows_gemm (bench/linear.py --dtype bfloat16, AVX512-BF16: 22 vs 25 ms at 3 rows, 29 vs
# 56 at 16; at 1 and 2 rows rows_gemm wins, 17-21 vs 24 ms).
PACKED_FROM = 3


class LinearOp(Protocol):
    nbytes: int  # bytes of weight it reads per call (what bounds decode)
    params: int  # weights it holds (elements)
    kernel: str  # which path serves small batches, for logs and Stats

    def __call__(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Kernels:
    """What the linear ops may use on this machine."""

    ops: object | None  # the compiled CPU kernels (kernels.cpu.load()), None without
    prepack_bf16: bool  # oneDNN's prepacked bf16 linear works here (AVX512-BF16 / AMX)
    isa: CpuIsa | None = None


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: w [out, in] ~= q * scale[:, None], |q| <= 127."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Fp32Linear:
    """float32 weights [out, in], as the checkpoint stores them (no copy where it is float32)."""

    def __init__(self, w: torch.Tensor, kernels: Kernels) -> None:
        self.w = w.float().contiguous()
        self.params = self.w.numel()
        self.nbytes = self.params * 4
        self._rows = getattr(kernels.ops, "rows_gemm", None)
        self.kernel = "rows_gemm" if self._rows else "mkl"

    def __call__(self, x, bias=None, residual=None):
        if self._rows is not None and x.shape[0] <= SMALL_M:
            return self._rows(x, self.w, None, bias, residual)
        if residual is None:
            return F.linear(x, self.w, bias)
        return torch.addmm(residual if bias is None else residual + bias, x, self.w.t())


class RowsLinear:
    """bf16 / fp16 weights [out, in], or int8 [out, in] with a per-row float32 scale."""

    def __init__(
        self,
        w: torch.Tensor,
        dtype: torch.dtype,
        kernels: Kernels,
        scale: torch.Tensor | None = None,
    ) -> None:
        self.w = w.contiguous()
        self.scale = scale
        self.dtype = dtype  # activations and output
        self.params = self.w.numel()
        self.nbytes = self.params * self.w.element_size()
        self._rows = getattr(kernels.ops, "rows_gemm", None)
        self.kernel = "rows_gemm" if self._rows else "torch"
        self._packed = None
        if kernels.prepack_bf16 and dtype == torch.bfloat16:
            self._packed = _prepack(self.dense())
        # rows_gemm up to SMALL_M rows, or below PACKED_FROM where the prepacked GEMM is there.
        self._rows_up_to = SMALL_M if self._packed is None else PACKED_FROM - 1
        # oneDNN's bf16 GEMM emulated on AVX2 is several times slower than widening the
        # weight and calling MKL's sgemm (bench/linear.py), so large batches widen there.
        self._widen = not kernels.prepack_bf16 and kernels.ops is not None

    def dense(self) -> torch.Tensor:
        """The weight as [out, in] in the activation dtype (dequantized if int8)."""
        if self.scale is None:
            return self.w.to(self.dtype)
        return (self.w.float() * self.scale[:, None]).to(self.dtype)

    def __call__(self, x, bias=None, residual=None):
        if self._rows is not None and x.shape[0] <= self._rows_up_to:
            return self._rows(x, self.w, self.scale, bias, residual)
        if self._packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        elif self._widen:  # float32 math on the widened weight, the result in x's dtype
            w = self.w.float() if self.scale is None else self.w.float() * self.scale[:, None]
            b = None if bias is None else bias.float()
            out = F.linear(x.float(), w, b).to(x.dtype)
        else:
            out = F.linear(x, self.dense(), bias)
        return out if residual is None else out.add_(residual)


class PartsLinear:
    """One projection made of several (a layer's q, k and v where the checkpoint does not
    hold their weights back to back): each part runs on its own weight, where the loader
    left it, and the outputs are concatenated, instead of copying the weights together."""

    def __init__(self, parts: list[LinearOp], sizes: list[int]) -> None:
        self.parts, self.sizes = parts, sizes
        self.params = sum(p.params for p in parts)
        self.nbytes = sum(p.nbytes for p in parts)
        self.kernel = parts[0].kernel

    def __call__(self, x, bias=None, residual=None):
        biases = bias.split(self.sizes) if bias is not None else [None] * len(self.parts)
        out = torch.cat([p(x, b) for p, b in zip(self.parts, biases, strict=True)], dim=-1)
        return out if residual is None else out.add_(residual)


def make_linear(
    w: torch.Tensor, dtype: torch.dtype, weight_dtype: str, kernels: Kernels
) -> LinearOp:
    """A projection over checkpoint weight `w` [out, in], run in `dtype`."""
    if weight_dtype == "int8":
        q, scale = quantize_int8(w)
        return RowsLinear(q, dtype, kernels, scale)
    if weight_dtype != "auto":
        raise ValueError(f"weight dtype must be 'auto' or 'int8', got {weight_dtype!r}")
    if dtype == torch.float32:
        return Fp32Linear(w, kernels)
    return RowsLinear(w.to(dtype), dtype, kernels)


def _prepack(w: torch.Tensor) -> object | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, None)
    except Exception:  # checked at start by prepack_works(); a shape it refuses stays dense
        return None


def prepack_works() -> bool:
    """Whether oneDNN's prepacked bf16 linear runs here and agrees with F.linear.

    The op lives in a private namespace that has moved between torch releases and refuses
    CPUs without native bf16, so it is resolved and checked once, never assumed.
    """
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(64, 96, generator=g).bfloat16()
        x = torch.randn(5, 96, generator=g).bfloat16()
        packed = ops._reorder_linear_weight(w, None)
        got = ops._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2))
    except Exception as exc:
        log.info("oneDNN prepacked bf16 linear unavailable: %s", exc)
        return False


def cpu_kernels(device: torch.device) -> Kernels:
    """The kernels linear ops may use on `device` (torch ops only off the CPU)."""
    if device.type != "cpu":
        return Kernels(ops=None, prepack_bf16=False)
    from rtp_serve.kernels import cpu
    from rtp_serve.kernels.isa import cpu_isa

    isa = cpu_isa()
    ops = cpu.load()
    prepack = isa.at_least("avx512_bf16") and prepack_works()
    return Kernels(ops=ops, prepack_bf16=prepack, isa=isa)
