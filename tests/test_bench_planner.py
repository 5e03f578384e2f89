"""bench/planner.py, test-sized: a 10 s day through real NATS, nameservice, master,
frontend and planner over simulated workers, against static provisioning; every row of its
table measured, and its plot written."""

from __future__ import annotations

from bench import planner


def test_planner_bench_measures_every_policy(model_dir, tmp_path):
    png = tmp_path / "planner.png"
    results = planner.main([
        "--day-s", "10", "--window-s", "5", "--peak-rate", "0.6", "--max-input", "256",
        "--max-output", "4", "--max-workers", "2", "--interval-s", "0.5",
        "--policies", "holt,static-mean", "--model", str(model_dir("tiny-llama")),
        "--png", str(png),
    ])  # fmt: skip
    assert [r["policy"] for r in results] == ["holt", "static-mean"]
    for r in results:
        assert r["requests"] > 0 and r["failed"] == 0
        assert 0 <= r["windows_met"] <= 1 and r["worker_s"] > 0
        assert r["ttft_p50"] <= r["ttft_p95"]
        assert r["replicas"] and max(n for _, n in r["replicas"]) >= 1
    assert results[0]["scale_events"] >= 1  # the planner started its first worker
    assert png.stat().st_size > 0
