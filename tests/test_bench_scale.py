"""bench/scale.py, test-sized: real NATS, nameservice, two masters and a frontend in front
of three simulated workers (their caches warm), a few trace requests cut short. Every row
of its table is measured, the masters' agreement (under an event cutoff, as deployed) and
one master's SIGKILL under load included; and a policy sweep's comparison table."""

from __future__ import annotations

import os

from bench import scale


def _flags(model_dir, tmp_path) -> list[str]:
    model = str(model_dir("tiny-llama"))
    return ["--workers", "3", "--requests", "6", "--max-input", "256", "--max-output", "2",
            "--time-scale", "0.001", "--idle-s", "0.5", "--capacity-s", "0.5", "--ttl", "1",
            "--procs", "1", "--model", model, "--log-dir", str(tmp_path)]  # fmt: skip


def test_scale_bench_measures_every_row(model_dir, tmp_path):
    flags = ["--probes", "6", "--failover-rate", "10", "--failover-s", "1.5", "--warm-blocks",
             "40", "--event-cutoff-ms", "50"]  # fmt: skip
    (result,) = scale.main(_flags(model_dir, tmp_path) + flags)
    # The warm caches reached both masters' indexes (each worker's 40 blocks) and were timed.
    assert result["warm"]["blocks"] == 3 * 40 and result["warm"]["rate"] > 0
    assert result["workers"] == 3 and result["requests"] == 6 and result["failed"] == 0
    assert result["routes"] >= 6  # over both masters; the victim's probes come after
    assert result["index_blocks"] > 0 and result["event_blocks_per_s"] > 0
    for key in ("route_p50_s", "route_p99_s", "event_lag_p99_s", "dead_worker_out_s",
                "master_resync_s"):  # fmt: skip
        assert result[key] is not None and result[key] >= 0, key
    assert result["route_p50_s"] <= result["route_p99_s"]
    # The master's GC pauses over the replay (None: a replay this short may make none).
    gc = result["master_gc"]
    assert gc is None or (gc["count"] >= max(1, gc["full"]) and gc["longest_le_s"] > 0)
    # Route calls back to back: answered, and the master's CPU counted for them.
    assert result["capacity_routes_per_s"] > 0 and result["capacity_routes_per_cpu_s"] > 0
    # The same through the frontend's route batcher: several routes a call.
    assert result["capacity_batched_routes_per_s"] > 0
    assert result["capacity_batched_mean_batch"] > 1
    assert result["ttft_p50_s"] > 0 and result["frontend_req_per_cpu_s"] > 0
    assert result["masters"] == 2 and result["probes"] == 6 and result["probe_failed"] == 0
    assert 0 <= result["agreement"] <= 1
    # One master SIGKILLed while requests stream: none fails, none is routed locally.
    assert result["failover_requests"] > 0 and result["failover_failed"] == 0
    assert result["failover_fallback_routes"] == 0


def test_policy_sweep_compares_each_policy_with_round_robin(model_dir, tmp_path, capsys):
    """With the master on a CPU of its own where there are two (--master-cpu): the bench
    process gets its own CPUs back at the end."""
    cpus = os.sched_getaffinity(0)
    flags = ["--policies", "round_robin,cache_aware", "--masters", "1", "--replay-only"]
    if len(cpus) > 1:
        flags += ["--master-cpu", str(max(cpus))]
    results = scale.main(_flags(model_dir, tmp_path) + flags)
    assert [r["policy"] for r in results] == ["round_robin", "cache_aware"]
    assert all(r["failed"] == 0 and "reuse_of_ceiling" in r for r in results)
    assert "p95 x rr" in capsys.readouterr().out
    assert os.sched_getaffinity(0) == cpus
