"""Projections at decode batch sizes: the compiled streaming kernel where it wins, else torch.

At a few rows a step, `x @ w` is memory-bound; MKL's sgemm reaches ~16 GB/s on the 2-core
dev box while kernels/csrc/small_gemm.cpp streams the weights at ~23 GB/s (1.4x at one row,
2-3x at 2-8 rows; bench/engine.py). Above SMALL_M rows the GEMM is compute-bound and MKL is
the better choice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SMALL_M = 32

Linear = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor
]


def torch_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """(residual +) x [T, in] @ w [in, out] (+ bias)."""
    if residual is not None:
        return torch.addmm(residual if bias is None else residual + bias, x, w)
    return torch.addmm(bias, x, w) if bias is not None else torch.mm(x, w)


def get_linear(device: torch.device, dtype: torch.dtype) -> Linear:
    if device.type != "cpu" or dtype != torch.float32:
        return torch_linear
    from kernels import cpu

    ops = cpu.load()
    if ops is None:
        return torch_linear
    small_gemm = ops.small_gemm

    def linear(x, w, bias=None, residual=None):
        if x.shape[0] <= SMALL_M:
            return small_gemm(x, w, bias, residual)
        return torch_linear(x, w, bias, residual)

    return linear
