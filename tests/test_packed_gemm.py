"""packed_gemm (kernels/csrc/packed_gemm.cpp) against torch.mm at every row count from 1 to
64 (every tile remainder), odd K and odd N (a partial last panel), every weight storage; and
the kernel tables (rtp_serve/kernels/gemm_table.py) that choose it per row count.

Tolerances as tests/test_linear_kernel.py: float32 1e-4 (summation order only); narrow
storage against the same widened weights in float32, 1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from rtp_serve.kernels import gemm_table
from rtp_serve.kernels.gemm_table import BUCKETS, KernelTable
from rtp_serve.kernels.linear import Fp32Linear, Kernels, pack_panels, quantize_int8, tune_linears
from tests.helpers import linear_case


@pytest.mark.parametrize("m", range(1, 65))
@pytest.mark.parametrize("k,n", [(33, 17), (131, 301)])
def test_packed_gemm_float32_matches_torch_mm(ops, m, k, n):
    x, w, bias, residual = linear_case(m, k, n)
    panels = pack_panels(w, ops.panel_width())
    torch.testing.assert_close(
        ops.packed_gemm(x, panels, n), torch.mm(x, w.t()), rtol=1e-4, atol=1e-4
    )
    got = ops.packed_gemm(x, panels, n, None, bias, residual)
    torch.testing.assert_close(got, torch.mm(x, w.t()) + bias + residual, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 16, 64, 200])
def test_packed_gemm_narrow_storage_matches_torch(ops, wdtype, m):
    x, w, bias, residual = linear_case(m, 77, 45)
    if wdtype == torch.int8:
        stored, scale = quantize_int8(w)
        dense = stored.float() * scale[:, None]
    else:
        stored, scale = w.to(wdtype), None
        dense = stored.float()
    got = ops.packed_gemm(x, pack_panels(stored, ops.panel_width()), 45, scale, bias, residual)
    torch.testing.assert_close(got, x @ dense.t() + bias + residual, rtol=1e-4, atol=1e-4)
    # bf16 activations in, bf16 out (the model's dtype), float32 inside
    xb = x.bfloat16()
    got = ops.packed_gemm(xb, pack_panels(stored, ops.panel_width()), 45, scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), xb.float() @ dense.t(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("k", [576, 1536, 4096])
def test_packed_gemm_error_is_no_worse_than_mkl(ops, k):
    """Against a float64 reference, packed_gemm's error stays at MKL's (torch.mm): it sums
    each block of K in fresh registers; one running sum over all of K had 2.35x HF's error
    on smollm2's logits (K = 1536)."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(64, k, generator=g), torch.randn(576, k, generator=g) * 0.05
    ref = x.double() @ w.double().t()
    ours = (ops.packed_gemm(x, pack_panels(w, ops.panel_width()), 576).double() - ref).abs()
    mkl = (torch.mm(x, w.t()).double() - ref).abs()
    assert ours.mean() <= 1.25 * mkl.mean()


def test_pack_panels_layout():
    """panels[p, k, j] == w[16 p + j, k]; the rows past N are zeros."""
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = pack_panels(w, 16)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[1, 2, 3], w[19, 2])
    assert torch.equal(panels[0, :, 5], w[5])
    assert not panels[1, :, 4:].any()


def test_packed_gemm_refuses_mismatched_shapes(ops):
    panels = pack_panels(torch.randn(20, 8), ops.panel_width())
    with pytest.raises(RuntimeError, match="N does not match"):
        ops.packed_gemm(torch.randn(2, 8), panels, 40)
    with pytest.raises(RuntimeError, match="disagree on K"):
        ops.packed_gemm(torch.randn(2, 9), panels, 20)
    with pytest.raises(RuntimeError, match="need a scale"):
        ops.packed_gemm(
            torch.randn(2, 8),
            pack_panels(torch.ones(20, 8, dtype=torch.int8), ops.panel_width()),
            20,
        )


def test_kernel_table_picks_by_row_count():
    table = KernelTable((2, 8, 64), ("rows_gemm", "packed_gemm", "mkl"))
    assert [table.pick(m) for m in (1, 2, 3, 8, 9, 64, 65, 4096)] == [
        "rows_gemm", "rows_gemm", "packed_gemm", "packed_gemm", "mkl", "mkl", "mkl", "mkl",
    ]  # fmt: skip
    split = KernelTable.split("rows_gemm", 32, "mkl")
    assert (split.pick(32), split.pick(33), split.pick(10_000)) == ("rows_gemm", "mkl", "mkl")
    runs = KernelTable((1, 2, 4, 8, 16), ("a", "a", "b", "b", "a"))
    assert runs.compact() == KernelTable((2, 8, 16), ("a", "b", "a"))
    assert runs.describe() == "1-2 a, 3-8 b, 9+ a"


class _Timed:
    """A stand-in op whose paths take known times: which one measure() picks is known."""

    nbytes = 1 << 20

    def __init__(self, slow_below: int) -> None:
        self.slow_below = slow_below  # "fast_small" is slow from this many rows on
        self.table = None

    def shape_key(self) -> str:
        return f"timed {self.slow_below}"

    def in_features(self) -> int:
        return 4

    def act_dtype(self) -> torch.dtype:
        return torch.float32

    def paths(self):
        def fast_small(x):
            time.sleep(0.004 if x.shape[0] >= self.slow_below else 0)

        def fast_large(x):
            time.sleep(0 if x.shape[0] >= self.slow_below else 0.004)

        return {"fast_small": fast_small, "fast_large": fast_large}

    def use(self, table):
        self.table = table


def test_measure_picks_the_faster_path_per_bucket():
    table = gemm_table.measure([_Timed(slow_below=24)])
    assert table.upto == BUCKETS
    assert table.compact().kernel == ("fast_small", "fast_large")
    assert table.pick(16) == "fast_small" and table.pick(24) == "fast_large"


def test_fit_keeps_the_path_order_through_noise():
    """Within noise the per-bucket winner flips; the fit keeps each path one run, in order."""
    names = ["rows_gemm", "packed_gemm", "mkl"]
    rel = [
        [1.0, 1.02, 5.0],
        [1.01, 1.0, 4.0],  # packed wins by a hair ...
        [1.0, 1.03, 3.0],  # ... and loses by one
        [1.3, 1.0, 2.0],
        [2.0, 1.0, 1.01],
        [3.0, 1.0, 1.02],
        [4.0, 1.1, 1.0],
    ]
    got = gemm_table.fit_runs(rel, names)
    assert got == ("rows_gemm",) * 3 + ("packed_gemm",) * 3 + ("mkl",)
    # a path that is never best gets no run at all
    assert gemm_table.fit_runs([[1.0, 2.0, 3.0], [1.5, 2.0, 1.0]], names) == ("rows_gemm", "mkl")


def test_tune_shares_a_table_per_shape_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RTP_SERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(gemm_table, "BUSY_SHARE", 1.0)  # cached however busy the machine is
    a, b, c = _Timed(24), _Timed(24), _Timed(8)
    tables = gemm_table.tune([a, b, c])
    assert a.table is b.table and a.table is not c.table and len(tables) == 2
    assert c.table.pick(8) == "fast_large" and a.table.pick(8) == "fast_small"
    files = sorted((tmp_path / "gemm").glob("*.json"))
    assert len(files) == 2
    # A restart reads the cache: a table written there is used as it is, not re-measured.
    seconds = tuple(1e-3 * r for r in BUCKETS)
    cached = KernelTable(BUCKETS, ("fast_large",) * len(BUCKETS), seconds)
    for f in files:
        f.write_text(json.dumps({"upto": cached.upto, "kernel": cached.kernel, "seconds": seconds}))
    d = _Timed(24)
    gemm_table.tune([d])
    assert d.table == cached
    # A cached table naming a path this op lacks (another build), measured at other row
    # counts (another release), or without its times (written before tables kept them), is
    # measured again.
    for stale in ({"upto": BUCKETS, "kernel": ["gone"] * len(BUCKETS), "seconds": seconds},
                  {"upto": [1], "kernel": ["fast_large"], "seconds": [1e-3]},
                  {"upto": BUCKETS, "kernel": ["fast_large"] * len(BUCKETS)}):  # fmt: skip
        for f in files:
            f.write_text(json.dumps(stale))
        e = _Timed(24)
        gemm_table.tune([e])
        assert set(e.table.kernel) == {"fast_small", "fast_large"}


def test_a_table_measured_while_others_take_the_cpus_is_used_but_not_cached(
    tmp_path, monkeypatch, caplog
):
    """Other processes spinning on every CPU this one may use: the measurement is skewed
    (towards paths with fewer threads), so it serves this start and the next measures
    again; /proc/stat is the witness."""
    monkeypatch.setenv("RTP_SERVE_CACHE", str(tmp_path))
    spin = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in os.sched_getaffinity(0)]
    try:
        time.sleep(0.5)  # past their start
        others = gemm_table.OthersShare()
        time.sleep(0.3)
        assert others.share() > 0.8  # what the spinners took, seen from here
        op = _Timed(24)
        gemm_table.tune([op])
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert op.table is not None and op.table.pick(8) == "fast_small"  # used
    assert not list((tmp_path / "gemm").glob("*.json"))  # not cached
    assert "not cached" in caplog.text
    quiet = gemm_table.OthersShare()  # nothing of ours running: a sleep takes no CPU
    time.sleep(0.3)
    assert quiet.share() < 0.8


@pytest.mark.parametrize("shares,cached", [((0.5, 0.0), True), ((0.5, 0.3), False)])
def test_a_shape_measured_while_contended_is_measured_again(tmp_path, monkeypatch, shares, cached):
    """Others' share is taken per shape: a contended shape is measured again, cached where
    the retry was quiet, used uncached where no try was. (The shares are scripted here; the
    test above has /proc/stat witness real spinners.)"""
    monkeypatch.setenv("RTP_SERVE_CACHE", str(tmp_path))
    script = iter(shares)

    class Scripted:
        def share(self) -> float:
            return next(script)

    tries = []
    monkeypatch.setattr(gemm_table, "OthersShare", Scripted)
    monkeypatch.setattr(gemm_table, "measure", lambda members: tries.append(1) or KernelTable(
        BUCKETS, ("fast_small",) * len(BUCKETS)))  # fmt: skip
    table, busy = gemm_table.measure_quietly([_Timed(24)])
    assert len(tries) == gemm_table.MEASURE_TRIES == 2 and busy == min(shares)
    script = iter((*shares, 0.0))  # then tune's own share of the whole run, for its log
    gemm_table.tune([_Timed(24)])
    assert bool(list((tmp_path / "gemm").glob("*.json"))) == cached


def test_tuned_op_drops_its_panels_where_unused(ops, tmp_path, monkeypatch):
    monkeypatch.setenv("RTP_SERVE_CACHE", str(tmp_path))
    kernels = Kernels(ops=ops, prepack_bf16=False)
    op = Fp32Linear(torch.randn(40, 24), kernels)
    assert op.panels is not None and set(op.paths()) == {"rows_gemm", "packed_gemm", "mkl"}
    op.use(KernelTable.split("rows_gemm", 8, "mkl"))
    assert op.panels is None and "packed_gemm" not in op.paths()
    x = torch.randn(20, 24)
    torch.testing.assert_close(op(x), F.linear(x, op.w), rtol=1e-4, atol=1e-4)
    # tune_linears gives real ops measured tables over their real paths
    ops2 = [Fp32Linear(torch.randn(40, 24), kernels) for _ in range(2)]
    tune_linears(ops2)
    assert ops2[0].table is ops2[1].table and ops2[0].table.upto == BUCKETS
    assert set(ops2[0].table.kernel) <= {"rows_gemm", "packed_gemm", "mkl"}
    # ... with each bucket's time on its chosen path: the efficiency curve
    assert len(ops2[0].table.seconds) == len(BUCKETS) and min(ops2[0].table.seconds) > 0
    assert gemm_table.efficient_rows(op.table for op in ops2) in BUCKETS


def test_efficient_rows_is_where_the_curve_reaches_its_plateau():
    # Time per row falls with the row count (a fixed cost amortized, wider tiles) to a
    # plateau: the first bucket within EFFICIENT_WITHIN of the least is the efficient one,
    # taken over the projections together.
    per_row = (10.0, 5.0, 3.0, 2.0, 1.5, 1.2, 1.15, 1.05, 1.0, 1.0)
    a = KernelTable(
        BUCKETS,
        ("mkl",) * len(BUCKETS),
        tuple(r * c for r, c in zip(BUCKETS, per_row, strict=True)),
    )
    assert gemm_table.efficient_rows([a]) == 128
    # A second projection whose curve flattens later moves the sum's plateau out.
    late = (10.0, 8.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.5, 1.05, 1.0)
    b = KernelTable(
        BUCKETS, ("mkl",) * len(BUCKETS), tuple(r * c for r, c in zip(BUCKETS, late, strict=True))
    )
    assert gemm_table.efficient_rows([a, b]) == 256
    # Not measured (the fixed split, a GPU's ops): unknown.
    assert gemm_table.efficient_rows([a, KernelTable.split("rows_gemm", 8, "mkl")]) is None
    assert gemm_table.efficient_rows([a, None]) is None
    assert gemm_table.efficient_rows([]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prepack", [False, True], ids=["no-onednn", "onednn"])
def test_parts_run_as_one_packed_gemm(ops, dtype, prepack):
    """q, k and v apart in the checkpoint: every path of the PartsLinear gives the joined
    projection, and its packed paths are one GEMM over the parts packed together: its own
    panels, and oneDNN's packing where oneDNN's prepacked linear runs in that dtype here
    (sizes that are not multiples of the panel width included)."""
    from rtp_serve.kernels.linear import PartsLinear, make_linear, prepack_works

    if prepack and not prepack_works(dtype):
        pytest.skip(f"oneDNN's prepacked {dtype} linear does not run here")
    x, w, bias, residual = linear_case(9, 64, 40 + 24 + 20)
    kernels = Kernels(
        ops=ops,
        prepack_bf16=prepack and dtype == torch.bfloat16,
        prepack_fp32=prepack and dtype == torch.float32,
    )
    sizes = [40, 24, 20]
    parts = [make_linear(p.to(dtype), dtype, "auto", kernels) for p in w.split(sizes)]
    names = list(parts[0].paths())
    op = PartsLinear(parts, sizes)
    assert op.panels is not None and all(p.panels is None for p in parts)
    assert list(op.paths()) == names  # the parts' paths, in their order
    assert ("onednn" in names) == prepack
    if prepack:  # one oneDNN packing of the joined weight, the parts' own dropped
        assert op._prepacked is not None and all(p._prepacked is None for p in parts)
        assert all("onednn" not in p.paths() for p in parts)
    xd, bd, rd = x.to(dtype), bias.to(dtype), residual.to(dtype)
    expected = F.linear(xd.float(), w.to(dtype).float(), bd.float()) + rd.float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, run in [("table", op), *op.paths().items()]:
        got = run(xd, bd, rd)
        assert got.shape == (9, 84) and got.dtype == dtype, name
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    assert "as parts [40, 24, 20]" in op.shape_key()


def test_untuned_ops_keep_the_fixed_split_and_pack_nothing(ops, monkeypatch):
    monkeypatch.setenv("RTP_SERVE_GEMM_TUNE", "0")
    op = Fp32Linear(torch.randn(40, 24), Kernels(ops=ops, prepack_bf16=False))
    tune_linears([op])
    assert op.table == KernelTable.split("rows_gemm", 32, "mkl") and op.panels is None
