"""bench/scale.py, test-sized: real NATS, nameservice, master and frontend in front of three
simulated workers, a few trace requests cut short. Every row of its table is measured."""

from __future__ import annotations

from bench import scale


def test_scale_bench_measures_every_row(model_dir, tmp_path):
    model = str(model_dir("tiny-llama"))
    flags = ["--workers", "3", "--requests", "6", "--max-input", "256", "--max-output", "2",
             "--time-scale", "0.001", "--idle-s", "0.5", "--ttl", "1", "--procs", "1", "--model", model,
             "--log-dir", str(tmp_path)]  # fmt: skip
    (result,) = scale.main(flags)
    assert result["workers"] == 3 and result["requests"] == 6 and result["failed"] == 0
    assert result["routes"] >= 6  # the victim's probes come after: not counted
    assert result["index_blocks"] > 0 and result["event_blocks_per_s"] > 0
    for key in ("route_p50_s", "route_p99_s", "event_lag_p99_s", "dead_worker_out_s",
                "master_resync_s"):  # fmt: skip
        assert result[key] is not None and result[key] >= 0, key
    assert result["route_p50_s"] <= result["route_p99_s"]
    assert result["ttft_p50_s"] > 0 and result["frontend_req_per_cpu_s"] > 0
