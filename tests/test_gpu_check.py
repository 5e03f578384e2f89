"""bench/gpu_check.py's arithmetic and table, on CPU (the check itself needs a GPU)."""

from __future__ import annotations

import pytest

from bench.gpu_check import Row, decode_roofline, format_table, prefill_roofline


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
