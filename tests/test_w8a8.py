"""W8A8 (rtp_serve/kernels/w8a8.py): per-row activation quantization, the VNNI panel layout,
the AVX512-VNNI kernel against torch's own int8 GEMM at every row count from 1 to 64 (odd K
and N), and the projection against float32. The kernel's integer sums are exact, so it and
torch._int_mm differ only in the float epilogue's rounding (1e-6 relative)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from rtp_serve.kernels.linear import Kernels, make_linear, quantize_int8
from rtp_serve.kernels.w8a8 import PANEL, W8A8Linear, pack_vnni, quantize_rows
from tests.helpers import linear_case


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The integer sums of int8 x [M, K] and w [N, K], in float64 (exact at these sizes)."""
    return x.double() @ w.double().t()


@pytest.fixture
def vnni(ops):
    if not ops.int8_gemm_supported():
        pytest.skip(
            "no AVX512-VNNI in the kernels in use (this CPU or RTP_SERVE_ISA): W8A8 runs on torch._int_mm alone"
        )
    return ops


def test_quantize_rows_is_symmetric_per_row():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3.0, 0.0, -3.0]])
    q, scale = quantize_rows(x, width=8)
    assert q.dtype == torch.int8 and q.shape == (3, 8) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, torch.tensor([2 / 127, 1.0, 3 / 127]))
    assert q[0, :3].tolist() == [64, -127, 32] and q[2, :3].tolist() == [127, 0, -127]
    assert not q[1].any() and not q[:, 3:].any()  # a zero row; the padding
    x = torch.randn(50, 97, generator=torch.Generator().manual_seed(1)).bfloat16()
    q, scale = quantize_rows(x)
    assert q.shape == (50, 97) and int(q.abs().max()) == 127
    torch.testing.assert_close(
        q.float() * scale[:, None], x.float(), rtol=0, atol=float(scale.max())
    )


def test_pack_vnni_puts_four_k_of_each_column_together():
    q = torch.randint(-127, 128, (70, 9), dtype=torch.int8)
    panels = pack_vnni(q)
    assert panels.shape == (3, 3, PANEL, 4) and panels.is_contiguous()
    for n, k in [(0, 0), (31, 8), (32, 5), (69, 3)]:
        assert panels[n // PANEL, k // 4, n % PANEL, k % 4] == q[n, k]
    assert not panels[2, :, 70 - 2 * PANEL :].any()  # columns past N
    assert not panels[:, 2, :, 1:].any()  # k past K


@pytest.mark.parametrize("m", range(1, 65))
def test_int8_gemm_matches_int_mm_at_every_row_count(vnni, m):
    k, n = 771, 67
    g = torch.Generator().manual_seed(m)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    xs, ws = torch.rand(m, generator=g) + 0.5, torch.rand(n, generator=g) / 100
    bias, residual = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    panels, sums = pack_vnni(w), w.sum(dim=1, dtype=torch.int32)
    xp = F.pad(xq, (0, 4 * panels.shape[1] - k))
    got = vnni.int8_gemm(xp, xs, panels, sums, ws, n, bias, residual)
    ints = torch._int_mm(xq, w.t())
    assert torch.equal(ints.double(), _exact(xq, w))  # the reference's sums are exact
    want = (ints.float() * xs[:, None]) * ws + bias + residual
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    plain = vnni.int8_gemm(xp, xs, panels, sums, ws, n)
    torch.testing.assert_close(plain, (ints.float() * xs[:, None]) * ws, rtol=1e-6, atol=1e-5)


def test_int8_gemm_takes_the_extreme_values_exactly(vnni):
    # Every product at its largest (-127 * -127 and 127 * -127 through the +128 offset).
    k, n = 2048, 32
    xq = torch.full((3, k), -127, dtype=torch.int8)
    xq[1] = 127
    w = torch.full((n, k), -127, dtype=torch.int8)
    w[::2] = 127
    got = vnni.int8_gemm(xq, torch.ones(3), pack_vnni(w), w.sum(1, dtype=torch.int32),
                         torch.ones(n), n)  # fmt: skip
    assert torch.equal(got.double(), _exact(xq, w))


def test_int8_gemm_refuses_bad_input(vnni):
    w = torch.zeros(8, 16, dtype=torch.int8)
    panels, sums = pack_vnni(w), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="4 \\* K4"):
        vnni.int8_gemm(torch.zeros(2, 12, dtype=torch.int8), torch.ones(2), panels, sums,
                       torch.ones(8), 8)  # fmt: skip
    with pytest.raises(RuntimeError, match="int8"):
        vnni.int8_gemm(torch.zeros(2, 16), torch.ones(2), panels, sums, torch.ones(8), 8)
    with pytest.raises(RuntimeError, match="N does not match"):
        vnni.int8_gemm(torch.zeros(2, 16, dtype=torch.int8), torch.ones(2), panels, sums,
                       torch.ones(8), 40)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 33, 80])
def test_w8a8_projection_paths_agree_and_stay_near_float(ops, dtype, m):
    x, w, bias, residual = linear_case(m, 96, 200)
    op = make_linear(w, dtype, "w8a8", Kernels(ops=ops, prepack_bf16=False))
    assert isinstance(op, W8A8Linear) and op.nbytes == w.numel()
    assert ("int8_gemm" in op.paths()) == ops.int8_gemm_supported()
    xd, bd, rd = x.to(dtype), bias.to(dtype), residual.to(dtype)
    # What the integer GEMM computes, from the same quantized operands.
    q, scale = quantize_int8(w)
    xq, xs = quantize_rows(xd)
    exact = (_exact(xq, q).float() * xs[:, None]) * scale + bd.float() + rd.float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, run in [("table", op), *op.paths().items()]:
        got = run(xd, bd, rd)
        assert got.dtype == dtype and got.shape == (m, 200), name
        torch.testing.assert_close(got.float(), exact, rtol=tol, atol=tol, msg=name)
    # Against float32 itself: the rounding of both operands, ~1% on random data.
    ref = F.linear(x, w)
    rel = (op(x.to(dtype)).float() - ref).norm() / ref.norm()
    assert rel < 0.03, rel


def test_w8a8_runs_on_the_cpu_only(model_dir):
    with pytest.raises(ValueError, match="w8a8.*CPU only"):
        EngineConfig(model=str(model_dir("tiny-llama")), weight_dtype="w8a8", device="cuda")
