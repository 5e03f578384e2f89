"""The planner's brain on known inputs: predictors, sizing arithmetic, the scaler's rules,
histogram quantiles from scrapes, and the local actuator over real processes."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path

import pytest

from rtp_serve.core.cost_model import StepCost
from rtp_serve.services.launcher.process import child_process
from rtp_serve.services.planner import sizing
from rtp_serve.services.planner.local_actuator import LocalActuator
from rtp_serve.services.planner.predictor import Holt, LastValue, make
from rtp_serve.services.planner.scaler import Limits, Scaler
from rtp_serve.services.planner.signals import Scrape, Window, quantile

# f = 10 ms a step, t = 0.1 ms a prompt token, w = 1 ms a decoding row, 512-token chunks
STEP = StepCost(fixed_s=0.010, token_s=1e-4, row_s=1e-3, token_budget=512)
MODEL = sizing.WorkerModel(STEP, max_num_seqs=64)


# -- predictors -------------------------------------------------------------------------------
def test_last_value_forecasts_the_last_observation() -> None:
    p = LastValue()
    assert p.forecast() == 0.0
    for x in (3.0, 7.0, 5.0):
        p.observe(x)
    assert p.forecast() == 5.0


def test_holt_follows_a_ramp_exactly_once_it_has_the_trend() -> None:
    p = Holt(alpha=1.0, beta=1.0)  # no smoothing: level = x, trend = last difference
    for x in (1.0, 2.0, 3.0):
        p.observe(x)
    assert p.forecast() == pytest.approx(4.0)


def test_holt_smooths_and_never_forecasts_below_zero() -> None:
    p = Holt(alpha=0.5, beta=0.5)
    p.observe(10.0)
    p.observe(0.0)  # level 5, trend -2.5 -> 2.5
    assert p.forecast() == pytest.approx(2.5)
    p.observe(0.0)  # level 1.25, trend -3.125 -> below 0
    assert p.forecast() == 0.0
    with pytest.raises(ValueError):
        Holt(alpha=0.0)
    with pytest.raises(ValueError):
        make("arima")


# -- sizing -----------------------------------------------------------------------------------
def test_decode_sizing_is_littles_law_over_the_step_cost() -> None:
    # 10 req/s x 100 tokens; one worker's itl = (f + w b) with b = 1000 * itl:
    # itl = 0.01 + 0.001 * 1000 * itl has no solution (w * rate * O = 1): one worker diverges.
    d = sizing.Demand(rate=10.0, prompt_tokens=0.0, output_tokens=100.0)
    t = sizing.Targets(ttft_p95_s=10.0, itl_p95_s=0.05, headroom=1.0)
    out = sizing.size_decode(MODEL, d, t, limit=16)
    # n workers: itl = 0.01 / (1 - 1/n); <= 0.05 needs 1/n <= 0.8: n = 2 (itl 20 ms, b 10)
    assert out.workers == 2 and out.feasible
    assert out.itl_s == pytest.approx(0.02, rel=1e-6)
    assert out.batch == pytest.approx(10.0, rel=1e-6)


def _mm1_ttft_p95(service_s: float, rate: float) -> float:
    # S + the wait's p95: P(wait > x) = rho exp(-(mu - lam) x) = 0.05
    rho = rate * service_s
    return service_s + max(0.0, math.log(20 * rho)) / (1 / service_s - rate)


def test_prefill_sizing_is_the_mm1_p95() -> None:
    # One 1,000-token prompt: 2 chunks x 10 ms + 1000 x 0.1 ms = 0.12 s of service.
    d = sizing.Demand(rate=20.0, prompt_tokens=1000.0, output_tokens=1.0)
    t = sizing.Targets(ttft_p95_s=0.5, itl_p95_s=1.0, headroom=1.0)
    out = sizing.size_prefill(MODEL, d, t, decode_step_s=0.0, limit=32)
    # n = 4: rho 0.6, 0.12 + ln(12) / (8.33 - 5) = 0.866 s; 5: 0.12 + ln(9.6) / 4.33 = 0.642;
    # 6: 0.12 + ln(8) / 5 = 0.536; 7: rho 0.343, 0.12 + ln(6.86) / 5.48 = 0.471 <= 0.5
    assert [_mm1_ttft_p95(0.12, 20 / n) <= 0.5 for n in (4, 5, 6, 7)] == [False] * 3 + [True]
    assert out.workers == 7
    assert out.ttft_p95_s == pytest.approx(_mm1_ttft_p95(0.12, 20 / 7))


def test_a_lone_prompt_waits_for_nothing() -> None:
    # Fewer than 1 in 20 requests find the worker busy: the p95 is the service time.
    d = sizing.Demand(rate=0.1, prompt_tokens=1000.0, output_tokens=1.0)
    out = sizing.size_prefill(MODEL, d, sizing.Targets(1.0, 1.0, 1.0), 0.0, limit=8)
    assert out.workers == 1 and out.ttft_p95_s == pytest.approx(0.12)


def test_sizing_wants_more_workers_as_the_rate_grows_and_none_at_zero() -> None:
    t = sizing.Targets(ttft_p95_s=1.0, itl_p95_s=0.1)
    counts = [
        sizing.size_fused(MODEL, sizing.Demand(r, 500.0, 100.0), t, limit=64).workers
        for r in (0.0, 0.5, 2.0, 8.0, 16.0)
    ]
    assert counts[0] == 0
    assert counts == sorted(counts) and counts[-1] > counts[1] >= 1


def test_unreachable_targets_ask_only_for_workers_that_help() -> None:
    # A 100k-token prompt: 196 chunks x 10 ms + 100k x 0.1 ms = 11.96 s of service, so no
    # worker count reaches a 1 s TTFT.
    t = sizing.Targets(1.0, 1.0, headroom=1.0)
    rare = sizing.Demand(rate=0.001, prompt_tokens=100_000.0, output_tokens=10.0)
    out = sizing.size_prefill(MODEL, rare, t, 0.0, limit=16)
    assert not out.feasible and out.workers == 1  # it never waits: more would not help
    assert out.ttft_p95_s == pytest.approx(11.96)
    # At 0.05 req/s, 16 workers give 11.96 s (rho 0.037: no wait at p95); the fewest within
    # 10% of that: 11 (0.0545 busy, 11.96 + ln(1.087) / 0.0791 = 13.02 s); 10 give 14.2 s.
    busy = sizing.Demand(rate=0.05, prompt_tokens=100_000.0, output_tokens=10.0)
    out = sizing.size_prefill(MODEL, busy, t, 0.0, limit=16)
    assert not out.feasible and out.workers == 11
    assert out.ttft_p95_s == pytest.approx(_mm1_ttft_p95(11.96, 0.05 / 11))
    assert _mm1_ttft_p95(11.96, 0.05 / 10) > 1.1 * 11.96
    # Over capacity even at the limit (0.5 req/s of 11.96 s prompts needs 6+): all of it.
    flood = sizing.Demand(rate=0.5, prompt_tokens=100_000.0, output_tokens=10.0)
    out = sizing.size_prefill(MODEL, flood, t, 0.0, limit=4)
    assert not out.feasible and out.workers == 4 and math.isinf(out.ttft_p95_s)


def test_a_correction_scales_the_service_time() -> None:
    d = sizing.Demand(rate=20.0, prompt_tokens=1000.0, output_tokens=1.0)
    t = sizing.Targets(ttft_p95_s=1.0, itl_p95_s=1.0, headroom=1.0)
    slow = sizing.WorkerModel(STEP, 64, prefill_correction=2.0)
    assert (
        sizing.size_prefill(slow, d, t, 0.0, 64).workers
        > sizing.size_prefill(MODEL, d, t, 0.0, 64).workers
    )


# -- scaler -----------------------------------------------------------------------------------
def test_scaler_goes_up_at_once_and_down_one_at_a_time_after_the_cooldown() -> None:
    s = Scaler(Limits(min_workers=1, max_workers=8, max_step_up=4, down_cooldown_s=30), ("fused",))
    up = s.decide(0.0, {"fused": 1}, {"fused": 7}, demand=True)
    assert up.targets == {"fused": 5}  # bounded step
    assert s.decide(1.0, {"fused": 5}, {"fused": 7}, True).targets == {"fused": 7}
    assert s.decide(2.0, {"fused": 7}, {"fused": 2}, True).targets == {"fused": 7}  # cooling
    assert s.decide(31.5, {"fused": 7}, {"fused": 2}, True).targets == {"fused": 6}
    assert s.decide(40.0, {"fused": 6}, {"fused": 2}, True).targets == {"fused": 6}
    assert s.decide(62.0, {"fused": 6}, {"fused": 2}, True).targets == {"fused": 5}


def test_scaler_keeps_the_budget_in_proportion() -> None:
    s = Scaler(Limits(max_workers=6, max_step_up=100), ("prefill", "decode"))
    d = s.decide(0.0, {"prefill": 0, "decode": 0}, {"prefill": 3, "decode": 9}, True)
    assert d.targets == {"prefill": 2, "decode": 4} or d.targets == {"prefill": 1, "decode": 5}
    assert sum(d.targets.values()) == 6 and min(d.targets.values()) >= 1


def test_scaler_goes_to_zero_when_idle_and_back_on_demand() -> None:
    s = Scaler(Limits(min_workers=0, idle_to_zero_s=60, down_cooldown_s=30), ("prefill", "decode"))
    assert s.decide(0.0, {"prefill": 1, "decode": 1}, {}, demand=True).targets == {
        "prefill": 1,
        "decode": 1,
    }
    assert s.decide(59.0, {"prefill": 1, "decode": 1}, {}, False).targets == {
        "prefill": 1,
        "decode": 1,
    }
    zero = s.decide(61.0, {"prefill": 1, "decode": 1}, {}, False)
    assert zero.targets == {"prefill": 0, "decode": 0} and "zero" in zero.reason
    # a request waits: one of each at once, whatever the cool-down
    assert s.decide(62.0, {"prefill": 0, "decode": 0}, {}, True).targets == {
        "prefill": 1,
        "decode": 1,
    }


def test_scaler_min_workers_one_never_goes_to_zero() -> None:
    s = Scaler(Limits(min_workers=1, idle_to_zero_s=1, down_cooldown_s=0), ("fused",))
    for now in range(0, 100, 10):
        assert s.decide(float(now), {"fused": 1}, {"fused": 0}, False).targets == {"fused": 1}


# -- signals ----------------------------------------------------------------------------------
EXPOSITION = """\
# TYPE rtp:requests_received counter
rtp:requests_received_total{{model_name="m"}} {arrived}
# TYPE rtp:prompt_tokens_received counter
rtp:prompt_tokens_received_total{{model_name="m"}} {arrived_prompt}
# TYPE rtp:request_success counter
rtp:request_success_total{{model_name="m",finished_reason="stop"}} {finished}
# TYPE rtp:prompt_tokens counter
rtp:prompt_tokens_total{{model_name="m"}} {prompt}
# TYPE rtp:generation_tokens counter
rtp:generation_tokens_total{{model_name="m"}} {output}
# TYPE rtp:requests_waiting_for_workers gauge
rtp:requests_waiting_for_workers {waiting}
# TYPE rtp:time_to_first_token_seconds histogram
rtp:time_to_first_token_seconds_bucket{{model_name="m",le="0.1"}} {b1}
rtp:time_to_first_token_seconds_bucket{{model_name="m",le="1.0"}} {b2}
rtp:time_to_first_token_seconds_bucket{{model_name="m",le="+Inf"}} {b2}
rtp:time_to_first_token_seconds_count{{model_name="m"}} {b2}
rtp:time_to_first_token_seconds_sum{{model_name="m"}} 1.0
"""


def _scrape(arrived_prompt: float = 0, **numbers: float) -> Scrape:
    return Scrape.parse(EXPOSITION.format(arrived_prompt=arrived_prompt, **numbers))


def test_window_is_the_difference_of_two_scrapes() -> None:
    a = _scrape(arrived=10, finished=8, prompt=800, output=80, waiting=0, b1=5, b2=8)
    b = _scrape(arrived=30, finished=28, prompt=2800, output=1080, waiting=2, b1=5, b2=28,
                arrived_prompt=3000)  # fmt: skip
    w = Window.of(10.0, [b.minus(a)])
    assert w.rate == 2.0 and w.finished == 20 and w.prompt_tokens == 2000
    assert w.arrived_prompt_tokens == 3000
    assert w.output_tokens == 1000 and w.waiting_for_workers == 2 and w.ttft_count == 20
    # all 20 new first tokens in (0.1, 1]: the p95 interpolates to 0.1 + 0.9 * 0.95
    assert w.ttft_p95_s == pytest.approx(0.1 + 0.9 * 0.95)


def test_a_restarted_frontend_counts_from_zero() -> None:
    before = _scrape(arrived=100, finished=90, prompt=1, output=1, waiting=0, b1=1, b2=1)
    after = _scrape(arrived=3, finished=1, prompt=1, output=1, waiting=0, b1=1, b2=1)
    assert after.minus(before).counters["rtp:requests_received"] == 3


def test_quantile_is_prometheus_histogram_quantile() -> None:
    assert math.isnan(quantile({}, 0.5))
    buckets = {0.5: 10.0, 1.0: 20.0, math.inf: 20.0}
    assert quantile(buckets, 0.5) == pytest.approx(0.5)
    assert quantile(buckets, 0.75) == pytest.approx(0.75)
    assert quantile({1.0: 0.0, math.inf: 4.0}, 0.5) == 1.0  # beyond the last finite bound


# -- the local actuator, over real processes --------------------------------------------------
DRAINER = (
    "import pathlib, signal, sys, time\n"
    "def stop(*_):\n"
    "    time.sleep(0.3)  # the drain\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "pathlib.Path(sys.argv[1]).touch()  # ready: SIGTERM drains from here on\n"
    "while True: time.sleep(0.05)\n"
)


async def _ready(paths: list[Path]) -> None:
    deadline = time.monotonic() + 30
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, "workers did not start"
        await asyncio.sleep(0.05)


def test_local_actuator_starts_and_stops_processes_gracefully(tmp_path: Path) -> None:
    def argv(role: str, worker_id: str) -> list[str]:
        return [sys.executable, "-c", DRAINER, str(tmp_path / worker_id)]

    async def run() -> None:
        act = LocalActuator(argv, child_process, drain_timeout_s=5.0, prefix="t")
        assert (await act.replicas())["fused"] == 0
        await act.scale("fused", 3)
        assert (await act.replicas())["fused"] == 3
        ids = [wid for _, wid, _ in act.running()]
        assert ids == ["t-fused-0", "t-fused-1", "t-fused-2"]
        await _ready([tmp_path / i for i in ids])
        procs = {w.worker_id: w.proc for w in act._workers}
        await act.scale("fused", 1, victims=["t-fused-1", "t-fused-0"])
        # the victims are stopping (not counted), and still draining
        assert (await act.replicas())["fused"] == 1
        deadline = time.monotonic() + 10
        while len(act.running()) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert [wid for _, wid, _ in act.running()] == ["t-fused-2"]
        assert procs["t-fused-0"].returncode == 0 and procs["t-fused-1"].returncode == 0  # drained
        await act.scale("fused", 2)
        assert (await act.replicas())["fused"] == 2
        await _ready([tmp_path / wid for _, wid, _ in act.running()])
        await act.close()
        assert act.running() == []
        assert procs["t-fused-2"].returncode == 0

    asyncio.run(run())


def test_local_actuator_replaces_nothing_itself_but_counts_a_crash_out() -> None:
    async def run() -> None:
        act = LocalActuator(lambda r, w: [sys.executable, "-c", "pass"], child_process, 1.0, "c")
        await act.scale("decode", 1)
        deadline = time.monotonic() + 10
        while (await act.replicas())["decode"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert (await act.replicas())["decode"] == 0  # the planner's next step starts another
        await act.close()

    asyncio.run(run())
