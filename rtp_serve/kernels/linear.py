"""Projections: a weight prepared once at load for the CPU it runs on, called per step.

`make_linear(w, ...)` takes a checkpoint weight [out, in] and returns a `LinearOp`, which
computes `(residual +) x @ w.T (+ bias)` for x [T, in] in the model's dtype. On the CPU an
op can run several ways (its paths), and its KernelTable picks one per row count T:

    path          reads the weight as                  serves best
    rows_gemm     [out, in], as loaded                 a few rows: each weight streamed once
    packed_gemm   column panels packed at load         a few to hundreds of rows: 6 x 16
                  (kernels/csrc/packed_gemm.cpp)       register tiles near the FMA peak
    mkl / widen   [out, in] (bf16 widened to fp32)     large prefill chunks: MKL's sgemm
    onednn        oneDNN's prepacked copy (fp32, or    large fp32 chunks where it beats MKL;
                  bf16 on avx512_bf16 / AMX CPUs)      bf16 from PACKED_FROM rows
    torch         F.linear in the model's dtype        off the CPU, or no compiled kernels

The table starts as the split measured on the first machines (rows_gemm up to SMALL_M rows,
then the large path); when a model loads, `gemm_table.tune()` times the paths on its own
shapes and replaces it (rtp_serve/kernels/gemm_table.py). The panels and oneDNN's packing
are copies of the weight; an op whose table never picks their path drops them.

Every weight keeps the checkpoint's [out, in] layout, so one already in the dtype it runs in
is used where the loader put it (a view of the mapped file: engine/weights.py), never
copied. The compiled kernels accumulate in float32 whatever the storage. Weight-only INT8 is
symmetric per output channel, quantized at load from the checkpoint (`quantize_int8`); it
halves bf16's weight bytes, which is what bounds decode. Without compiled kernels
(RTP_SERVE_ISA=scalar) every op is the torch reference, which is also what tests compare to.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from rtp_serve.kernels import gemm_table
from rtp_serve.kernels.gemm_table import KernelTable
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
    prepack_fp32: bool = False  # oneDNN's prepacked float32 linear works here


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: w [out, in] ~= q * scale[:, None], |q| <= 127."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class TunedLinear:
    """A projection that can run several ways (its `paths`) and runs each call on the one
    its KernelTable picks for the row count. The table starts as the fixed split measured
    on the first machines (SMALL_M); `gemm_table.tune()` replaces it with one measured here."""

    w: torch.Tensor
    scale: torch.Tensor | None  # int8's, per output row
    panels: torch.Tensor | None
    packed_gemm: Callable[..., torch.Tensor] | None
    table: KernelTable
    _paths: dict[str, Callable[..., torch.Tensor]]
    _prepacked: object | None = None  # oneDNN's own packing of the weight (the onednn path)

    def __call__(self, x, bias=None, residual=None):
        return self._paths[self.table.pick(x.shape[0])](x, bias, residual)

    @property
    def kernel(self) -> str:  # what serves a one-row decode step
        return self.table.pick(1)

    def paths(self) -> dict[str, Callable[..., torch.Tensor]]:
        return dict(self._paths)

    def use(self, table: KernelTable) -> None:
        self.table = table
        if "packed_gemm" not in table.kernel and self.panels is not None:
            self.panels = None  # the packed copy serves no row count: its memory back
            del self._paths["packed_gemm"]
        if "onednn" not in table.kernel and self._prepacked is not None:
            self._prepacked = None  # oneDNN's copy, alike
            del self._paths["onednn"]

    def in_features(self) -> int:
        return self.w.shape[1]

    def _onednn(self, x, bias=None, residual=None):
        """The onednn path: oneDNN's GEMM over `_prepacked`."""
        out = torch.ops.mkldnn._linear_pointwise(x, self._prepacked, bias, "none", [], "")
        return out if residual is None else out.add_(residual)

    def _compiled_paths(self, ops) -> None:
        """rows_gemm over the weight where it lies, packed_gemm over a packed copy."""
        rows, packed = ops.rows_gemm, ops.packed_gemm
        self.panels = pack_panels(self.w, ops.panel_width())
        self._paths["rows_gemm"] = lambda x, b=None, r=None: rows(x, self.w, self.scale, b, r)
        self._paths["packed_gemm"] = lambda x, b=None, r=None: packed(
            x, self.panels, self.w.shape[0], self.scale, b, r
        )

    def act_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def shape_key(self) -> str:
        scaled = "+scale" if self.scale is not None else ""
        n, k = self.w.shape
        return f"{type(self).__name__} {n}x{k} {self.w.dtype}{scaled} -> {self.act_dtype()}"


class Fp32Linear(TunedLinear):
    """float32 weights [out, in], as the checkpoint stores them (no copy where it is float32),
    and, where oneDNN's prepacked linear works, its packing of them: the large GEMM path
    beside MKL's (on an AVX-512 EPYC oneDNN's large GEMM ran at 226 GFLOPS against MKL's
    191-202, bench/gemm.py); the table keeps whichever is faster here."""

    def __init__(self, w: torch.Tensor, kernels: Kernels) -> None:
        self.w = w.float().contiguous()
        self.params = self.w.numel()
        self.nbytes = self.params * 4
        self.panels, self.scale = None, None
        self._paths = {}  # fewest rows first: the order a KernelTable keeps
        ops = kernels.ops
        self.packed_gemm = getattr(ops, "packed_gemm", None)
        if ops is not None:
            self._compiled_paths(ops)
        self._paths["mkl"] = self._mkl
        if kernels.prepack_fp32 and ops is not None:
            self._prepacked = _prepack(self.w)
            if self._prepacked is not None:
                self._paths["onednn"] = self._onednn
        small = "rows_gemm" if ops is not None else "mkl"
        self.table = KernelTable.split(small, SMALL_M, "mkl")

    def act_dtype(self) -> torch.dtype:
        return torch.float32

    def _mkl(self, x, bias=None, residual=None):
        if residual is None:
            return F.linear(x, self.w, bias)
        return torch.addmm(residual if bias is None else residual + bias, x, self.w.t())


class RowsLinear(TunedLinear):
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
        self.panels = None
        if kernels.prepack_bf16 and dtype == torch.bfloat16:
            self._prepacked = _prepack(self.dense())
        # oneDNN's bf16 GEMM emulated on AVX2 is several times slower than widening the
        # weight and calling MKL's sgemm (bench/linear.py), so large batches widen there.
        if self._prepacked is not None:
            large = "onednn"
        elif not kernels.prepack_bf16 and kernels.ops is not None:
            large = "widen"
        else:
            large = "torch"
        self._paths = {}  # fewest rows first: the order a KernelTable keeps
        ops = kernels.ops
        self.packed_gemm = getattr(ops, "packed_gemm", None)
        if ops is not None:
            self._compiled_paths(ops)
        self._paths[large] = getattr(self, f"_{large}")
        if ops is not None:
            # rows_gemm up to SMALL_M rows, or below PACKED_FROM where oneDNN's is there.
            up_to = SMALL_M if self._prepacked is None else PACKED_FROM - 1
            self.table = KernelTable.split("rows_gemm", up_to, large)
        else:
            self.table = KernelTable.split(large, 1, large)

    def act_dtype(self) -> torch.dtype:
        return self.dtype

    def dense(self) -> torch.Tensor:
        """The weight as [out, in] in the activation dtype (dequantized if int8)."""
        if self.scale is None:
            return self.w.to(self.dtype)
        return (self.w.float() * self.scale[:, None]).to(self.dtype)

    def _widen(self, x, bias=None, residual=None):
        """float32 math on the widened weight, the result in x's dtype."""
        w = self.w.float() if self.scale is None else self.w.float() * self.scale[:, None]
        b = None if bias is None else bias.float()
        out = F.linear(x.float(), w, b).to(x.dtype)
        return out if residual is None else out.add_(residual)

    def _torch(self, x, bias=None, residual=None):
        out = F.linear(x, self.dense(), bias)
        return out if residual is None else out.add_(residual)


def pack_panels(w: torch.Tensor, width: int) -> torch.Tensor:
    """w [N, K] as packed_gemm streams it: [ceil(N / width), K, width], zero rows padding N
    (kernels/csrc/packed_gemm.cpp draws the layout)."""
    n, k = w.shape
    p = -(-n // width)
    return F.pad(w, (0, 0, 0, p * width - n)).view(p, width, k).transpose(1, 2).contiguous()


class PartsLinear(TunedLinear):
    """One projection made of several (a layer's q, k and v where the checkpoint does not
    hold their weights back to back). The unpacked paths run each part on its own weight,
    where the loader left it, and concatenate the outputs, instead of copying the weights
    together; packed_gemm and onednn, which copy them anyway, pack them as one weight and
    run once (one GEMM for q, k and v, no concatenation: a prefill chunk's output is copied
    once less)."""

    def __init__(self, parts: list[TunedLinear], sizes: list[int]) -> None:
        self.parts, self.sizes = parts, sizes
        self.params = sum(p.params for p in parts)
        self.nbytes = sum(p.nbytes for p in parts)
        first = parts[0]
        self.w, self.scale, self.panels = first.w, None, None  # w: in_features and dtype
        self._paths = {}
        for name in first.paths():  # the parts' order
            if name == "packed_gemm":
                self._paths[name] = self._packed_path(parts)
            elif name == "onednn" and self._join_prepacked(parts):
                self._paths[name] = self._onednn
            else:
                self._paths[name] = functools.partial(self._each, [p._paths[name] for p in parts])
        self.table = first.table

    def _join_prepacked(self, parts: list[TunedLinear]) -> bool:
        """oneDNN's packing of the parts as one weight, in place of theirs; False (each part
        keeps its own) where oneDNN refuses the joined shape."""
        self._prepacked = _prepack(torch.cat([p.w for p in parts]))  # in the parts' dtype
        if self._prepacked is None:
            return False
        for p in parts:
            p._prepacked = None
            del p._paths["onednn"]
        return True

    def _packed_path(self, parts: list[TunedLinear]) -> Callable[..., torch.Tensor]:
        gemm, n = parts[0].packed_gemm, sum(self.sizes)
        self.panels = pack_panels(torch.cat([p.w for p in parts]), parts[0].panels.shape[2])
        if parts[0].scale is not None:
            self.scale = torch.cat([p.scale for p in parts])
        for p in parts:  # each part's own panels serve nothing now
            p.panels = None
            del p._paths["packed_gemm"]
        return lambda x, b=None, r=None: gemm(x, self.panels, n, self.scale, b, r)

    def use(self, table: KernelTable) -> None:
        super().use(table)
        for p in self.parts:  # their own copies for paths the table never picks
            p.use(table)

    def _each(self, fns, x, bias=None, residual=None):
        biases = bias.split(self.sizes) if bias is not None else [None] * len(fns)
        out = torch.cat([fn(x, b) for fn, b in zip(fns, biases, strict=True)], dim=-1)
        return out if residual is None else out.add_(residual)

    def act_dtype(self) -> torch.dtype:
        return self.parts[0].act_dtype()

    def shape_key(self) -> str:
        return f"{self.parts[0].shape_key()} as parts {self.sizes}"


def tune_linears(ops: Iterable[LinearOp], cache: bool = True) -> None:
    """Give every CPU projection of a model the kernel table measured for its shape.
    RTP_SERVE_GEMM_TUNE=0 keeps the fixed split (what ran before tables were measured:
    bench/gemm.py and bench/engine.py compare the two)."""
    tunable = [op for op in ops if isinstance(op, TunedLinear) and len(op.paths()) > 1]
    if os.environ.get("RTP_SERVE_GEMM_TUNE", "1") == "0":
        for op in tunable:
            op.use(op.table)  # the fixed split, which packs nothing: the panels go
    elif tunable:
        gemm_table.tune(tunable, cache=cache)


def make_linear(
    w: torch.Tensor, dtype: torch.dtype, weight_dtype: str, kernels: Kernels
) -> LinearOp:
    """A projection over checkpoint weight `w` [out, in], run in `dtype`."""
    if weight_dtype == "int8":
        q, scale = quantize_int8(w)
        return RowsLinear(q, dtype, kernels, scale)
    if weight_dtype == "w8a8":
        from rtp_serve.kernels.w8a8 import W8A8Linear  # it builds on this module's TunedLinear

        return W8A8Linear(w, dtype, kernels)
    if weight_dtype != "auto":
        raise ValueError(f"weight dtype must be 'auto', 'int8' or 'w8a8', got {weight_dtype!r}")
    if dtype == torch.float32:
        return Fp32Linear(w, kernels)
    return RowsLinear(w.to(dtype), dtype, kernels)


def _prepack(w: torch.Tensor) -> object | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, None)
    except Exception:  # checked at start by prepack_works(); a shape it refuses stays dense
        return None


@functools.cache
def prepack_works(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether oneDNN's prepacked linear runs here in `dtype` and agrees with F.linear.

    The op lives in a private namespace that has moved between torch releases and refuses
    bf16 on CPUs without native bf16, so it is resolved and checked once, never assumed.
    """
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(64, 96, generator=g).to(dtype)
        x = torch.randn(5, 96, generator=g).to(dtype)
        packed = ops._reorder_linear_weight(w, None)
        got = ops._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), rtol=tol, atol=tol))
    except Exception as exc:
        log.info("oneDNN prepacked %s linear unavailable: %s", dtype, exc)
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
    # RTP_SERVE_ONEDNN_FP32=0: float32 without oneDNN's packed copy (what ran before it;
    # bench/engine.py compares the two).
    fp32 = (
        ops is not None
        and os.environ.get("RTP_SERVE_ONEDNN_FP32", "1") != "0"
        and prepack_works(torch.float32)
    )
    return Kernels(ops=ops, prepack_bf16=prepack, isa=isa, prepack_fp32=fp32)
