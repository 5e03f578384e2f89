"""bench/serve.py and bench/workload.py: metrics on scripted results, the datasets, the
arrival processes, and one short run through the real code path on the in-process engine."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bench import hops, workload
from bench.serve import (
    RequestResult,
    by_round,
    load_points,
    main,
    medians,
    metric_stats,
    parse_args,
    summarize,
)


# -- metrics ---------------------------------------------------------------------------------
def test_tpot_excludes_the_first_token_and_itl_pools_gaps():
    # ttft 100 ms, then 4 more tokens over 200 ms: TPOT 50 ms. One token: no TPOT.
    results = [
        RequestResult(True, 10, 5, ttft=0.1, latency=0.3, itl=[0.05, 0.05, 0.04, 0.06]),
        RequestResult(True, 20, 1, ttft=0.2, latency=0.2),
        RequestResult(False, 30, error="HTTP 500: boom"),
    ]
    r = summarize(results, duration=2.0)
    assert (r["completed"], r["failed"]) == (2, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (30, 6)
    assert r["request_throughput"] == 1.0
    assert r["output_throughput"] == 3.0
    assert r["total_token_throughput"] == 18.0
    assert r["mean_tpot_ms"] == pytest.approx(50.0)
    assert r["std_tpot_ms"] == pytest.approx(0.0)
    assert r["mean_ttft_ms"] == pytest.approx(150.0)
    assert r["mean_itl_ms"] == pytest.approx(50.0)
    assert r["mean_e2el_ms"] == pytest.approx(250.0)
    assert r["error_kinds"] == ["HTTP 500: boom"]
    assert "errors" not in r and "ttfts" not in r  # only with detailed
    detailed = summarize(results, 2.0, detailed=True)
    assert detailed["output_lens"] == [5, 1, 0]
    assert detailed["errors"] == ["", "", "HTTP 500: boom"]


def test_percentiles_are_keyed_as_vllm_and_interpolate():
    s = metric_stats("ttft", [i / 1000 for i in range(1, 101)], [50, 90, 99, 99.9])
    assert set(s) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms",
                      "p90_ttft_ms", "p99_ttft_ms", "p99.9_ttft_ms"}  # fmt: skip
    assert s["median_ttft_ms"] == pytest.approx(50.5)
    assert s["p90_ttft_ms"] == pytest.approx(90.1)  # linear, as numpy and vLLM
    assert s["p99_ttft_ms"] == pytest.approx(99.01)
    assert s["std_ttft_ms"] == pytest.approx(np.std(np.arange(1, 101)))
    assert metric_stats("itl", [], [99]) == {
        "mean_itl_ms": 0.0, "median_itl_ms": 0.0, "std_itl_ms": 0.0, "p99_itl_ms": 0.0,
    }  # fmt: skip


# -- datasets --------------------------------------------------------------------------------
def test_random_prefix_comes_on_top_of_the_input_len():
    reqs = workload.random_requests(5, 12, 7, vocab=100, seed=3, prefix_len=4)
    assert [len(r.prompt) for r in reqs] == [16] * 5
    assert {tuple(r.prompt[:4]) for r in reqs} == {tuple(reqs[0].prompt[:4])}
    assert all(10 <= t < 100 for r in reqs for t in r.prompt)
    assert reqs == workload.random_requests(5, 12, 7, vocab=100, seed=3, prefix_len=4)


def test_prefix_repetition_structure():
    reqs = workload.prefix_repetition_requests(11, 8, 5, 3, 9, vocab=1000, seed=0)
    assert len(reqs) == 9  # 3 prefixes x (11 // 3), as vLLM
    assert all(len(r.prompt) == 13 and r.output_len == 9 for r in reqs)
    prefixes = Counter(tuple(r.prompt[:8]) for r in reqs)
    assert sorted(prefixes.values()) == [3, 3, 3]
    assert len({tuple(r.prompt[8:]) for r in reqs}) == 9  # every suffix its own
    with pytest.raises(ValueError):
        workload.prefix_repetition_requests(2, 8, 5, 3, 9, vocab=1000, seed=0)


def _trace(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 64, "hash_ids": [7, 8, 9]},
    {"timestamp": 1500, "input_length": 600, "output_length": 10, "hash_ids": [7, 5]},
    {"timestamp": 4000, "input_length": 1024, "output_length": 3, "hash_ids": [7, 8]},
    {"timestamp": 9000, "input_length": 10, "output_length": 1, "hash_ids": [1]},
]


def test_mooncake_equal_hash_ids_give_equal_blocks(tmp_path):
    reqs = workload.mooncake_requests(_trace(tmp_path, ROWS), vocab=500, block_len=16)
    a, b, c, _ = reqs
    assert a.prompt[:16] == b.prompt[:16] == c.prompt[:16]  # hash id 7
    assert a.prompt[16:32] == c.prompt[16:32]  # hash id 8
    assert b.prompt[16:32] != a.prompt[16:32]  # 5 vs 8
    assert a.prompt[:16] == workload.block_tokens(7, 16, 500)
    again = workload.mooncake_requests(_trace(tmp_path, ROWS), vocab=500, block_len=16)
    assert again == reqs


def test_mooncake_lengths_scale_and_caps_cut(tmp_path):
    path = _trace(tmp_path, ROWS)
    reqs = workload.mooncake_requests(path, vocab=500, block_len=16)
    # ceil(len * 16 / 512) tokens in, round(len * 16 / 512) out, at least 1
    assert [len(r.prompt) for r in reqs] == [35, 19, 32, 1]
    assert [r.output_len for r in reqs] == [2, 1, 1, 1]
    full = workload.mooncake_requests(path, vocab=500)  # block_len 512: the trace's lengths
    assert [len(r.prompt) for r in full] == [1100, 600, 1024, 10]
    assert [r.output_len for r in full] == [64, 10, 3, 1]
    cut = workload.mooncake_requests(path, vocab=500, num_requests=3, max_input_len=700,
                                     max_output_len=20)  # fmt: skip
    assert [len(r.prompt) for r in cut] == [700, 600, 700]
    assert [r.output_len for r in cut] == [20, 10, 3]
    assert cut[2].prompt == full[2].prompt[:700]


def test_mooncake_times_from_the_first_line_scaled(tmp_path):
    path = _trace(tmp_path, ROWS)
    assert [r.arrival_s for r in workload.mooncake_requests(path, 500)] == [0, 0.5, 3.0, 8.0]
    fast = workload.mooncake_requests(path, 500, time_scale=0.1)
    assert [r.arrival_s for r in fast] == pytest.approx([0, 0.05, 0.3, 0.8])


def test_mooncake_skip_starts_later_with_times_from_there(tmp_path):
    path = _trace(tmp_path, ROWS)
    full = workload.mooncake_requests(path, 500, block_len=16)
    later = workload.mooncake_requests(path, 500, block_len=16, num_requests=2, skip=1)
    assert [r.prompt for r in later] == [r.prompt for r in full[1:3]]
    assert [r.arrival_s for r in later] == [0, 2.5]
    with pytest.raises(ValueError, match="trace.jsonl:2"):  # line numbers count what was skipped
        bad = ROWS[:1] + [
            {"timestamp": 9, "input_length": 600, "output_length": 1, "hash_ids": [1]}
        ]
        workload.mooncake_requests(_trace(tmp_path, bad), 500, skip=1)


def test_mooncake_refuses_a_line_longer_than_its_blocks(tmp_path):
    bad = [{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}]
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        workload.mooncake_requests(_trace(tmp_path, bad), vocab=500)


def test_the_repo_trace_loads_as_a_small_slice():
    trace = Path("/work/shared/traces/mooncake_synthetic.jsonl")
    if not trace.exists():
        pytest.skip("no shared trace here")
    reqs = workload.mooncake_requests(trace, 8000, 16, num_requests=50, max_input_len=256)
    assert len(reqs) == 50 and max(len(r.prompt) for r in reqs) <= 256
    assert reqs[0].arrival_s == 0 and all(
        a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)
    )


# -- arrivals --------------------------------------------------------------------------------
@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_gaps_mean_one_over_rate_and_shape_sets_the_spread(burstiness):
    gaps = workload.inter_arrival_gaps(20_000, 8.0, burstiness, np.random.default_rng(1))
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.05)
    # a gamma's coefficient of variation is 1 / sqrt(shape): Poisson 1, burstier above
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrival_times_are_seeded_and_normalized():
    a = workload.arrival_times(100, 10.0, 1.0, seed=7)
    assert a == workload.arrival_times(100, 10.0, 1.0, seed=7)
    assert a != workload.arrival_times(100, 10.0, 1.0, seed=8)
    assert a == sorted(a) and a[-1] == pytest.approx(10.0)  # n / rate, as vLLM
    assert workload.arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5
    even = workload.arrival_times(4, 2.0, math.inf, seed=0)
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError):
        workload.arrival_times(4, 2.0, 0.0, seed=0)


# -- the real path ---------------------------------------------------------------------------
def test_smoke_against_the_in_process_engine(
    model_dir: Callable[[str], Path], tmp_path: Path, capsys
):
    model = model_dir("tiny-llama")
    results = main(["--compare", "--topologies", "engine", "--model", str(model),
                    "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                    "--max-concurrency", "2", "--request-rate", "50", "--disable-tqdm",
                    "--num-warmups", "1", "--save-result", "--result-dir", str(tmp_path),
                    "--result-file", "r.json"])  # fmt: skip
    r = results["engine"]
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (4, 0, 32)
    assert r["total_input_tokens"] == 64 and r["mean_tpot_ms"] > 0
    out = capsys.readouterr().out
    assert "CPU ISA:" in out and "x first" in out and "\nengine " in out
    # Its engine threads (named rtp-engine) apart from the rest of this process.
    assert set(r["cpu_us_per_token"]) == {"engine", "client"}
    assert "# engine: CPU per output token: engine " in out
    assert "# floor" not in out  # paced by its arrivals: no floor of the machine's
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["target"] == "engine" and saved["cpu_isa"]["level"]
    assert saved["request_rate"] == 50.0 and saved["p99_itl_ms"] > 0


def test_concurrency_sweep_runs_each_load_with_prompts_of_its_own(
    model_dir: Callable[[str], Path], capsys
):
    model = model_dir("tiny-llama")
    args = parse_args(
        ["--compare", "--sweep-concurrency", "1,3", "--num-prompts", "2", "--input-len", "16"]
    )
    points = load_points(args, 500)
    assert [(p.label, len(p.requests), p.max_concurrency) for p in points] == [
        ("c=1", 2, 1), ("c=3", 6, 3),
    ]  # fmt: skip
    first = {tuple(r.prompt) for r in points[0].requests}
    assert not first & {tuple(r.prompt) for r in points[1].requests}
    results = main(["--compare", "--topologies", "engine", "--model", str(model),
                    "--sweep-concurrency", "1,3", "--num-prompts", "2", "--input-len", "16",
                    "--output-len", "4", "--disable-tqdm", "--num-warmups", "1",
                    "--no-floor"])  # fmt: skip
    assert list(results) == ["engine c=1", "engine c=3"]
    assert [results[k]["completed"] for k in results] == [2, 6]
    assert results["engine c=3"]["max_concurrency"] == 3
    out = capsys.readouterr().out
    assert "c=1 2 requests, c=3 6 requests" in out


def test_rounds_give_medians_and_ratios_paired_round_by_round():
    """Scripted rounds: each number's median (NaNs left out, hops per hop, failures summed),
    and each row against the first target's same load in the same round."""

    def row(tok, p50, p95, failed=0, hop=10.0):
        return {"output_throughput": tok, "median_ttft_ms": p50, "p95_ttft_ms": p95,
                "failed": failed, "error_kinds": ["timeout"] if failed else [],
                "ttft_hops_ms": {"worker queue": hop}}  # fmt: skip

    rounds = [
        {"vllm c=4": row(100, 10, 20), "fused:1 c=4": row(120, 9, 22, failed=1, hop=4.0)},
        {"vllm c=4": row(80, 12, 30), "fused:1 c=4": row(100, 12, 27, hop=6.0)},
        {"vllm c=4": row(90, math.nan, 25), "fused:1 c=4": row(99, 11, 30, hop=8.0)},
    ]
    m = medians([r["fused:1 c=4"] for r in rounds])
    assert (m["output_throughput"], m["median_ttft_ms"], m["p95_ttft_ms"]) == (100, 11, 27)
    assert m["ttft_hops_ms"] == {"worker queue": 6.0}
    assert m["failed"] == 1 and m["error_kinds"] == ["timeout"]
    assert medians([r["vllm c=4"] for r in rounds])["median_ttft_ms"] == 11  # NaN left out
    (line,) = by_round(rounds, "vllm")
    assert line.startswith("# fused:1 c=4 / vllm c=4: out tok/s 1.20 1.25 1.10 (median 1.20)")
    assert "TTFT p95 1.10 0.90 1.20 (median 1.10)" in line
    assert "TTFT p50 0.90 1.00 (median 0.95)" in line  # the round with no baseline p50 is out


def test_rounds_against_the_in_process_engine_save_each_round_and_the_medians(
    model_dir: Callable[[str], Path], tmp_path: Path, capsys
):
    model = model_dir("tiny-llama")
    results = main(["--compare", "--topologies", "engine", "--model", str(model),
                    "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
                    "--rounds", "2", "--disable-tqdm", "--num-warmups", "1", "--save-result",
                    "--result-dir", str(tmp_path), "--result-file", "r.json"])  # fmt: skip
    assert results["engine"]["completed"] == 2 and results["engine"]["failed"] == 0
    out = capsys.readouterr().out
    assert "# medians over 2 rounds" in out
    saved = [json.loads(line) for line in (tmp_path / "r.json").read_text().splitlines()]
    assert [s["round"] for s in saved] == [1, 2, "median"]
    assert all(s["target"] == "engine" for s in saved)
    # Sent all at once: the load's floor on this machine (bench/roofline.py), and the
    # engine's duration as a share of it.
    floor = saved[-1]["floor_roofline_s"]
    assert 0 < floor <= saved[-1]["floor_serial_s"]
    assert "# floor of the load (float32): 2 requests, 32 prompt + 6 decode tokens" in out
    share = round(100 * floor / saved[-1]["duration"])
    assert f"#   engine: {saved[-1]['duration']:.1f} s = {share}% of the roofline" in out


def test_ttft_hops_add_up_to_the_clients_ttft():
    """bench/hops.py on scripted scrapes: means of the run's increase, the rest is transit."""
    before = {"frontend": (1.0, 2), "admit and route": (0.1, 2),
              "worker queue": (0.2, 2), "worker prefill": (0.5, 2)}  # fmt: skip
    after = {"frontend": (2.0, 6), "admit and route": (0.14, 6),
             "worker queue": (0.28, 6), "worker prefill": (1.1, 6)}  # fmt: skip
    got = hops.split(before, after, client_ttft_ms=300.0)
    assert got["HTTP and client"] == pytest.approx(50.0)  # 300 - 1000 ms / 4
    assert got["admit and route"] == pytest.approx(10.0)
    assert got["worker queue"] == pytest.approx(20.0)
    assert got["worker prefill"] == pytest.approx(150.0)
    assert got["transit"] == pytest.approx(70.0)
    parts = sum(v for k, v in got.items() if k != "client TTFT")
    assert parts == pytest.approx(300.0)
    assert hops.describe(got).startswith("TTFT 300.0 ms = HTTP and client 50.0 (17%)")


def test_route_ceiling_counts_chained_full_blocks_of_earlier_prompts():
    from bench.route import ceiling_tokens

    a, b, c = [1] * 4, [2] * 4, [3] * 4  # blocks of 4 tokens
    prompts = [
        a + b + [9],  # nothing before it
        a + b + [8],  # a, b seen: 8 tokens
        a + c + b,  # a seen, c not: the chain stops there (b after a hole does not count)
        a + c + b,  # all 3 blocks seen, but the last token is always computed: 2 blocks
        a,  # one block; its only token-bearing block must be computed: 0
    ]
    assert ceiling_tokens(prompts, 4) == 8 + 4 + 8 + 0
    assert ceiling_tokens([], 4) == 0


def test_route_repetitions_are_medians_and_ratios_pair_each_repetition_with_its_own_baseline():
    from bench.route import Run, median_of, table

    def result(p95: float, cached: int, failed: int = 0) -> dict:
        return {
            "completed": 10, "failed": failed, "median_ttft_ms": p95 / 2, "p95_ttft_ms": p95,
            "p99_ttft_ms": p95, "p99_itl_ms": 5.0, "cached_tokens": cached,
            "prediction_abs_error_s": math.nan, "prediction_late": math.nan,
            "hits": {"T0": cached}, "cpu_s": {"fused": 1.0},
        }  # fmt: skip

    rr, ca = Run("fused:3", False, "round_robin"), Run("fused:3", False, "cache_aware")
    # repetition 2 ran on a machine twice as slow: both policies took twice as long
    rows = {rr: [result(100, 10), result(200, 10), result(120, 10)],
            ca: [result(50, 30, failed=1), result(100, 20), result(90, 40)]}  # fmt: skip
    merged = median_of(rows[ca])
    assert merged["p95_ttft_ms"] == 90 and merged["cached_tokens"] == 30
    assert merged["failed"] == 1 and merged["hits"] == {"T0": 30}
    line = next(x for x in table(rows, 100, 50).splitlines() if "cache_aware" in x)
    # per-repetition ratios 0.5, 0.5, 0.75: median 0.50 (medians of each, 90 / 120, would be 0.75)
    assert " 0.50 " in line and "0.50-0.75" in line and " 30.0% " in line and " 60.0% " in line
    # A variant (more launcher flags) pairs with its own round_robin, named apart.
    variant = "--max-num-seqs 16"
    rows[Run("fused:3", False, "round_robin", variant)] = [result(400, 10)]
    rows[Run("fused:3", False, "cache_aware", variant)] = [result(100, 30)]
    line = next(x for x in table(rows, 100, 50).splitlines() if f"[{variant}] cache_aware" in x)
    assert " 0.25 " in line
    # Each repetition's ratios are listed, for p95 against round_robin and p50 tiers off / on.
    on = Run("fused:3", True, "cache_aware")
    rows[on] = [result(25, 30), result(80, 30), result(30, 30)]
    text = table(rows, 100, 50)
    assert "fused:3 tiers=off cache_aware: p95 x rr by repetition 0.50 0.50 0.75" in text
    # tiers=on has no round_robin of its own; its p50s (half of p95) against tiers off's
    assert "fused:3 tiers=on cache_aware: p50 off / on by repetition 2.00 1.25 3.00" in text
    assert "tiers=on cache_aware: p95 x rr" not in text


def test_route_tier_columns_count_where_prompts_are_computed():
    from bench.route import count_tier_hits

    def worker(role: str, device: int, host: int) -> str:
        return "".join(
            f'rtp:prefix_cache_hits_total{{role="{role}",model_name="m",tier="{tier}"}} {n}\n'
            for tier, n in (("device", device), ("host", host), ("remote", 7))
        )

    cache = 'rtp:cache_service_hits_total{tier="memory"} 5\nrtp:cache_service_hits_total{tier="redis"} 2\n'
    # Each worker's device hits include its host copy-ups; a PD decode worker's copy-ups
    # (it already held part of a transferred prompt) are not prompt reuse, and one worker's
    # copy-ups never lower another's T0.
    texts = [worker("prefill", 10, 4), worker("prefill", 3, 0), worker("decode", 0, 9), cache]
    assert count_tier_hits(texts) == {"T0": 9, "T1": 4, "T2": 5, "T3": 2}
    # A worker whose copy-ups outnumber its admitted hits (copied up at lookup, evicted
    # again before admission) reads T0 0, and leaves the other's 5 whole (summed first: 2).
    hits = count_tier_hits([worker("fused", 0, 3), worker("fused", 5, 0)])
    assert (hits["T0"], hits["T1"]) == (5, 3)


def test_route_reads_the_frontends_request_lines_and_splits_the_prediction():
    from bench.route import first_token_lines, prediction_terms

    log = "\n".join([
        "2026-12-03 08:00:00 INFO [frontend] services.frontend.generation first token: "
        "worker=fused-a prompt_tokens=64 cached_tokens=16 predicted_s=0.3000 "
        "predicted_wait_s=0.1000 predicted_prefill_s=0.1500 predicted_fetch_s=0.0500 "
        "actual_s=0.4000 queue_s=0.1500 prefill_s=0.2200",
        '{"level": "INFO", "msg": "first token: worker=fused-b prompt_tokens=8 cached_tokens=0 '
        "predicted_s=0.1000 predicted_wait_s=0.0000 predicted_prefill_s=0.1000 "
        'predicted_fetch_s=0.0000 actual_s=0.0600 queue_s=0.0000 prefill_s=0.0500"}',
        "2026-12-03 08:00:01 INFO [fused] other line",
        # the master predicted nothing (a fallback route): not counted in the terms
        "x first token: worker=fused-a prompt_tokens=8 cached_tokens=0 predicted_s=0.0000 "
        "predicted_wait_s=0 predicted_prefill_s=0 predicted_fetch_s=0 actual_s=9 queue_s=0 "
        "prefill_s=9",
    ])  # fmt: skip
    records = first_token_lines(log)
    assert [r["worker"] for r in records] == ["fused-a", "fused-b", "fused-a"]
    assert records[1]["prefill_s"] == "0.0500"  # the JSON line's closing quote is not a value
    terms = prediction_terms(records)
    assert terms["predicted"] == 2
    assert terms["predicted_s"] == pytest.approx(0.2) and terms["actual_s"] == pytest.approx(0.23)
    assert terms["predicted_fetch_s"] == pytest.approx(0.025)
    assert terms["hops_s"] == pytest.approx((0.03 + 0.01) / 2)
    assert terms["median_error_s"] == pytest.approx((0.1 - 0.04) / 2)
    assert terms["abs_error_s"] == pytest.approx(0.07) and terms["late"] == 0.5
    assert prediction_terms([]) == {}
