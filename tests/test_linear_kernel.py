"""The streaming small-batch GEMM against torch's, with and without bias and residual."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu
from kernels.linear import SMALL_M, get_linear, torch_linear


@pytest.fixture(scope="module")
def ops():
    ops = cpu.load()
    if ops is None:
        pytest.fail("the CPU kernels did not build (set RTP_SERVE_CPU_KERNELS=0 to run without)")
    return ops


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 17, SMALL_M])
@pytest.mark.parametrize("k,n", [(64, 96), (130, 7), (768, 2304)])
def test_small_gemm_matches_torch(ops, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    bias, residual = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    for b, r in ((None, None), (bias, None), (None, residual), (bias, residual)):
        expected = x @ w + (0 if b is None else b) + (0 if r is None else r)
        got = ops.small_gemm(x, w, b, r)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(residual, residual.clone())  # the residual is not written in place


def test_dispatch_uses_torch_for_large_batches_and_other_dtypes(ops):
    x, w = torch.randn(SMALL_M + 1, 16), torch.randn(16, 8)
    torch.testing.assert_close(get_linear(torch.device("cpu"), torch.float32)(x, w), x @ w)
    assert get_linear(torch.device("cpu"), torch.bfloat16) is torch_linear
