"""Every projection path against the torch reference: the compiled kernels (rows_gemm for
float32/bf16/fp16/int8 storage [out, in]; small_gemm for [in, out], which LoRA's updates
use), the large-batch paths, and INT8 quantization.

Tolerances: float32 storage 1e-4 (summation order only); bf16/fp16 storage 1e-4 against the
same widened weights in float32 (the kernel accumulates in float32); bf16 activations 2e-2
relative (one bf16 rounding of the output); INT8 against its own dequantized weights 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtp_serve.kernels import cpu
from rtp_serve.kernels.gemm_table import KernelTable
from rtp_serve.kernels.isa import LEVELS, resolve
from rtp_serve.kernels.linear import (
    PACKED_FROM,
    SMALL_M,
    Fp32Linear,
    Kernels,
    RowsLinear,
    cpu_kernels,
    make_linear,
    prepack_works,
    quantize_int8,
)
from tests.helpers import linear_case


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 17, SMALL_M])
@pytest.mark.parametrize("k,n", [(64, 96), (130, 7), (768, 2304)])
def test_small_gemm_matches_torch(ops, m, k, n):
    x, w, bias, residual = linear_case(m, k, n)
    w = w.t().contiguous()
    for b, r in ((None, None), (bias, None), (None, residual), (bias, residual)):
        expected = x @ w + (0 if b is None else b) + (0 if r is None else r)
        got = ops.small_gemm(x, w, b, r)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(residual, residual.clone())  # the residual is not written in place


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9, SMALL_M])
@pytest.mark.parametrize("k,n", [(64, 96), (130, 7), (13, 5), (768, 2304)])
def test_rows_gemm_matches_torch(ops, wdtype, m, k, n):
    """Odd K (no full vector), N not a multiple of the 4-row block, 1..32 rows."""
    x, w, bias, residual = linear_case(m, k, n)
    scale = None
    if wdtype == torch.int8:
        q, scale = quantize_int8(w)
        dense = q.float() * scale[:, None]
    else:
        q = w.to(wdtype)
        dense = q.float()
    for b, r in ((None, None), (bias, None), (None, residual), (bias, residual)):
        expected = F.linear(x, dense, b) + (0 if r is None else r)
        got = ops.rows_gemm(x, q, scale, b, r)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # bf16 activations in, bf16 out: the float32 result rounded once.
    got = ops.rows_gemm(x.bfloat16(), q, scale, None, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got.float(), F.linear(x.bfloat16().float(), dense), rtol=2e-2, atol=2e-2
    )


def test_rows_gemm_refuses_bad_input(ops):
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="need a scale"):
        ops.rows_gemm(x, torch.zeros(4, 8, dtype=torch.int8), None, None, None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        ops.rows_gemm(x, torch.zeros(4, 9, dtype=torch.bfloat16), None, None, None)


def test_quantize_int8_is_symmetric_per_channel():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [127.0, 3.0, -127.0]])
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (3,)
    assert q.abs().max() <= 127 and q[0, 1] == -127 and q[2, 0] == 127
    torch.testing.assert_close(q.float() * scale[:, None], w, atol=scale.max().item() / 2, rtol=0)
    assert torch.all(q[1] == 0)  # an all-zero row quantizes without dividing by zero


# Every path a LinearOp can take, each forced: compiled kernels or not, prepacked or not.
_KERNEL_SETS = {
    "reference": lambda ops: Kernels(ops=None, prepack_bf16=False),
    "compiled": lambda ops: Kernels(ops=ops, prepack_bf16=False),
    # oneDNN's prepacked copies, where this machine runs them (a no-op elsewhere)
    "prepacked": lambda ops: Kernels(
        ops=ops, prepack_bf16=prepack_works(), prepack_fp32=prepack_works(torch.float32)
    ),
}


@pytest.mark.parametrize("path", sorted(_KERNEL_SETS))
@pytest.mark.parametrize(
    "dtype,weight_dtype",
    [
        (torch.float32, "auto"),
        (torch.bfloat16, "auto"),
        (torch.float16, "auto"),
        (torch.float32, "int8"),
        (torch.bfloat16, "int8"),
    ],
)
@pytest.mark.parametrize("m", [1, 7, SMALL_M, SMALL_M + 1, 80])
def test_linear_ops_match_reference(ops, path, dtype, weight_dtype, m):
    x, w, bias, residual = linear_case(m, 96, 200)
    op = make_linear(
        w.to(dtype) if weight_dtype == "auto" else w, dtype, weight_dtype, _KERNEL_SETS[path](ops)
    )
    if weight_dtype == "int8":
        q, scale = quantize_int8(w)
        dense = (q.float() * scale[:, None]).to(dtype)
    else:
        dense = w.to(dtype)
    xd, bd, rd = x.to(dtype), bias.to(dtype), residual.to(dtype)
    expected = F.linear(xd.float(), dense.float(), bd.float()) + rd.float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # The op's table picks one path per row count: every path must give the same answer.
    for name, run in [("table", op), *op.paths().items()]:
        got = run(xd, bd, rd)
        assert got.dtype == dtype and got.shape == (m, 200), name
        torch.testing.assert_close(
            got.float(), expected, rtol=tol, atol=tol, msg=lambda e, name=name: f"{name}: {e}"
        )
    assert op.nbytes == w.numel() * (1 if weight_dtype == "int8" else dense.element_size())


def test_int8_weights_are_close_to_the_float_weights():
    """Per-channel INT8 keeps a projection's output within ~1% of float32 (random weights)."""
    x, w, _, _ = linear_case(16, 768, 512)
    op = make_linear(w, torch.float32, "int8", Kernels(ops=cpu.load(), prepack_bf16=False))
    ref = F.linear(x, w)
    rel = (op(x) - ref).norm() / ref.norm()
    assert rel < 0.01, rel


def test_kernel_choice_follows_the_machine(ops):
    kernels = cpu_kernels(torch.device("cpu"))
    assert kernels.ops is not None and kernels.isa is not None
    assert isinstance(make_linear(torch.randn(8, 4), torch.float32, "auto", kernels), Fp32Linear)
    op = make_linear(torch.randn(8, 4).bfloat16(), torch.bfloat16, "auto", kernels)
    assert isinstance(op, RowsLinear) and op.kernel == "rows_gemm"
    # The prepacked oneDNN path is used exactly where it works (AVX512-BF16 / AMX machines).
    assert kernels.prepack_bf16 == (kernels.isa.at_least("avx512_bf16") and prepack_works())
    assert kernels.prepack_fp32 == prepack_works(torch.float32)
    with pytest.raises(ValueError, match="weight dtype"):
        make_linear(torch.randn(8, 4), torch.float32, "int4", kernels)


@pytest.mark.skipif(not prepack_works(), reason="oneDNN prepacked bf16 needs AVX512-BF16 / AMX")
@pytest.mark.parametrize("m", [PACKED_FROM - 1, PACKED_FROM, 7, SMALL_M + 1, 200])
def test_prepacked_bf16_matches_reference(ops, m):
    """From PACKED_FROM rows on the prepacked GEMM, below it rows_gemm: both as reference."""
    x, w, bias, residual = linear_case(m, 96, 200)
    op = make_linear(w.bfloat16(), torch.bfloat16, "auto", Kernels(ops=ops, prepack_bf16=True))
    assert op._prepacked is not None
    got = op(x.bfloat16(), bias.bfloat16(), residual.bfloat16())
    expected = F.linear(x.bfloat16().float(), w.bfloat16().float(), bias.bfloat16().float())
    torch.testing.assert_close(
        got.float(), expected + residual.bfloat16().float(), rtol=2e-2, atol=3e-2
    )


def test_isa_levels_cap_but_never_raise():
    flags = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
    assert resolve(flags, None).level == "avx512_bf16"
    capped = resolve(flags, "avx2")
    assert capped.level == "avx2" and capped.hardware == "avx512_bf16"
    assert "capped" in capped.describe()
    assert resolve(frozenset({"avx2", "fma", "f16c"}), "amx").level == "avx2"  # never above
    assert resolve(frozenset({"avx2", "fma"}), None).level == "scalar"  # the build needs F16C
    assert resolve(frozenset(), None).level == "scalar"
    with pytest.raises(ValueError, match="RTP_SERVE_ISA"):
        resolve(flags, "sse9")
    assert set(LEVELS) >= {"scalar", "avx2", "amx"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,h", [(1, 768), (3, 13), (300, 576)])
def test_rms_norm_kernel_matches_the_reference(ops, dtype, rows, h):
    """float32: within 1e-5; bf16/fp16: HF's two roundings, so at most one ulp apart."""
    from rtp_serve.engine.models.llama import rms_norm

    g = torch.Generator().manual_seed(rows + h)
    x = (3 * torch.randn(rows, h, generator=g)).to(dtype)
    w = torch.randn(h, generator=g).to(dtype)
    got, ref = ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rms_norm(x, w.float() if dtype != torch.float32 else w.double(), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rope_kernel_matches_the_reference_bit_for_bit(ops, dtype, tokens):
    """q and k as the model passes them (a view of the fused qkv rows, heads of 64), cos and
    sin [T, 1, D]: each product and the sum rounded as torch rounds them."""
    from rtp_serve.engine.models.llama import apply_rope

    g = torch.Generator().manual_seed(tokens)
    qkv = (3 * torch.randn(tokens, 7 * 64, generator=g)).to(dtype)
    x = qkv[:, : 5 * 64].view(-1, 5, 64)  # 3 query heads and 2 kv heads, v left out
    cos, sin = (torch.randn(tokens, 1, 64, generator=g).to(dtype) for _ in range(2))
    got = ops.rope(x, cos, sin)
    assert got.is_contiguous() and got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got, apply_rope(x, cos, sin))
    with pytest.raises(RuntimeError, match="x's dtype"):
        ops.rope(x, cos.double(), sin.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 2048), (5, 13), (300, 576)])
def test_silu_mul_kernel_matches_the_reference(ops, dtype, rows, inter):
    """float32: within a few ulps (its exp is a polynomial, torch's Sleef's); bf16/fp16: the
    same two roundings as torch's silu then multiply, so at most one ulp apart."""
    from rtp_serve.engine.models.llama import silu_mul

    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's range ends, and zero
    got, ref = ops.silu_mul(gate_up), silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (rows, inter) and got.is_contiguous()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    wider = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * inter]  # rows of a wider tensor
    torch.testing.assert_close(ops.silu_mul(wider).float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.skipif(not prepack_works(torch.float32), reason="oneDNN prepacked fp32 unavailable")
def test_prepacked_fp32_is_a_path_the_table_can_pick_or_drop(ops):
    """float32 gets oneDNN's packing as a fourth path; a table without it frees the copy."""
    x, w, bias, residual = linear_case(48, 96, 200)
    kernels = Kernels(ops=ops, prepack_bf16=False, prepack_fp32=True)
    op = make_linear(w, torch.float32, "auto", kernels)
    assert list(op.paths()) == ["rows_gemm", "packed_gemm", "mkl", "onednn"]
    op.use(KernelTable.split("packed_gemm", 32, "onednn"))
    expected = F.linear(x, w, bias) + residual
    torch.testing.assert_close(op(x, bias, residual), expected, rtol=1e-4, atol=1e-4)
    op.use(KernelTable.split("rows_gemm", 32, "mkl"))
    assert op._prepacked is None and "onednn" not in op.paths()
