"""bench/gpu_check.py's arithmetic and table, on CPU (the check itself needs a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import (
    Row,
    _try,
    _try_rows,
    decode_roofline,
    exit_status,
    failures,
    format_table,
    prefill_roofline,
)


def test_decode_roofline_counts_weights_once_and_kv_per_sequence():
    # 1 GB of weights, 10 kB of KV per token, 100-token contexts, 1 TB/s.
    assert decode_roofline(10**9, 10**4, 100, 1, 1e12) == pytest.approx(1e12 / (10**9 + 10**6))
    # Batch 128: the weights are shared, the KV is not.
    step = 10**9 + 128 * 100 * 10**4
    assert decode_roofline(10**9, 10**4, 100, 128, 1e12) == pytest.approx(128 * 1e12 / step)


def test_prefill_roofline_is_two_flops_per_weight_per_token():
    assert prefill_roofline(10**8, 1e15) == pytest.approx(5e6)


def test_table_aligns_columns_under_one_header():
    text = format_table([Row("machine", "device", "H200"), Row("parity", "tiny-llama", "ok", "ok")])
    lines = text.splitlines()
    assert lines[0].split() == ["section", "what", "value", "target", "/", "roofline"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[3].index("tiny-llama") == lines[0].index("what")
    assert lines[3].index("ok") == lines[0].index("value")


def test_a_mismatch_or_a_raised_stage_fails_the_check():
    ok = [Row("parity", "tiny-llama", "ok (triton)", "ok"), Row("parity", "real", "n/a: none")]
    assert exit_status(ok) == 0
    differs = Row("parity bf16", "tiny-llama triton", "DIFFERS (prompt 1, token 3)")
    assert failures([*ok, differs]) == [differs]
    assert exit_status([*ok, differs]) == 1
    assert exit_status([*ok, Row("error", "kernel_rows", "RuntimeError: boom")]) == 1


def test_try_tells_a_missing_package_from_a_failure():
    def missing() -> str:
        raise ImportError("No module named 'flash_attn'")

    def broken() -> str:
        raise RuntimeError("CUDA error: an illegal memory access")

    assert _try(missing).startswith("n/a: ImportError")
    assert _try(broken).startswith("FAILED: RuntimeError")
    assert _try_rows(lambda: [][0])[0].section == "error"


# The shell script on a machine without a GPU: $PYTHON is a stand-in interpreter that
# passes the CUDA pre-check and pip, answers pytest with a chosen status, and runs the real
# bench.gpu_check.exit_status over one parity row of a chosen value.
_INTERPRETER = """#!/usr/bin/env bash
case "$1" in
  -m) if [ "$2" = pytest ]; then echo "1 passed"; exit "$PYTEST_STATUS"; fi; exit 0 ;;
  -c) exit 0 ;;
  -) cat >/dev/null; exit 0 ;;
  bench/gpu_check.py)
    exec "$REAL_PYTHON" -c 'import os, sys
from bench.gpu_check import Row, exit_status
sys.exit(exit_status([Row("parity", "tiny-llama", os.environ["PARITY"])]))' ;;
esac
exit 99
"""


@pytest.mark.parametrize(
    "pytest_status,parity,expected",
    [(0, "ok (triton)", 0), (1, "ok (triton)", 1), (0, "DIFFERS (prompt 0, token 2)", 1)],
)
def test_gpu_check_sh_exits_non_zero_on_a_failed_test_or_mismatch(
    tmp_path, pytest_status, parity, expected
):
    root = Path(__file__).resolve().parent.parent
    interpreter = tmp_path / "python"
    interpreter.write_text(_INTERPRETER)
    interpreter.chmod(0o755)
    env = {
        **os.environ,
        "PYTHON": str(interpreter),
        "REAL_PYTHON": sys.executable,
        "PYTEST_STATUS": str(pytest_status),
        "PARITY": parity,
        "PYTHONPATH": str(root),
    }
    run = subprocess.run(
        ["bash", str(root / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True
    )
    assert (run.returncode != 0) == bool(expected), run.stdout + run.stderr
