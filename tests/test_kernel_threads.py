"""The kernels' split of work between threads (kernels/csrc/parallel.h: chunks the threads
take in turn) gives torch.mm's results at any thread count, including more threads than
chunks and counts that divide nothing evenly; the rest of the kernel tests run at 2."""

from __future__ import annotations

import pytest
import torch

from rtp_serve.kernels.linear import pack_panels
from tests.helpers import linear_case


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n_threads", [1, 3, 7])
@pytest.mark.parametrize("m", [1, 2, 7, 64])
@pytest.mark.parametrize("n", [17, 301, 1000])
def test_gemms_match_torch_mm_at_any_thread_count(ops, threads, n_threads, m, n):
    threads(n_threads)
    x, w, bias, residual = linear_case(m, 131, n)
    want = torch.mm(x, w.t()) + bias + residual
    panels = pack_panels(w, ops.panel_width())
    got = ops.packed_gemm(x, panels, n, None, bias, residual)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    got = ops.rows_gemm(x, w, None, bias, residual)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
