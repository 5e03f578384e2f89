"""The engine's measured rates and the wait estimate built from them (engine/step_rate.py)."""

from __future__ import annotations

import pytest

from engine.step_rate import ALPHA, StepRate, StepTimer


def test_unmeasured_engine_estimates_no_wait():
    assert StepRate().queue_wait_s(queued_tokens=5000, num_running=3) == 0.0


def test_rates_follow_the_steps():
    timer = StepTimer()
    timer.observe(0.5, prompt_tokens=500, decode_tokens=2)  # first sample taken as is
    timer.observe(0.01, prompt_tokens=0, decode_tokens=4)
    assert timer.rate == StepRate(prefill_tokens_per_s=1000.0, decode_step_s=0.01)
    timer.observe(1.0, prompt_tokens=500, decode_tokens=0)  # slower now: 500 tokens/s
    assert timer.rate.prefill_tokens_per_s == pytest.approx(1000.0 + ALPHA * (500.0 - 1000.0))
    timer.observe(0.0, prompt_tokens=10, decode_tokens=0)  # no time measured: ignored
    timer.observe(0.2, prompt_tokens=0, decode_tokens=0)  # no work: ignored
    assert timer.rate.decode_step_s == 0.01


def test_wait_is_queued_tokens_at_the_prompt_rate_plus_a_running_step():
    rate = StepRate(prefill_tokens_per_s=1000.0, decode_step_s=0.02)
    assert rate.queue_wait_s(queued_tokens=500, num_running=0) == pytest.approx(0.5)
    assert rate.queue_wait_s(queued_tokens=500, num_running=8) == pytest.approx(0.52)
    assert rate.queue_wait_s(queued_tokens=0, num_running=0) == 0.0
