"""The online-fitted cost models (rtp_serve/core/cost_model.py): they converge on the coefficients
that generated the measurements, follow a change, and predict with the chunking rule."""

from __future__ import annotations

import random

import pytest

from rtp_serve.core.cost_model import CostModel, FetchCost, LinearFit, StepCost


def test_unfitted_models_predict_nothing():
    model = CostModel(token_budget=512)
    assert model.step() == StepCost(token_budget=512) and not model.step().fitted
    assert model.step().queue_wait_s(queued_tokens=5000, running=3) == 0.0
    assert model.fetch() == {}
    model.observe_step(0.1, prompt_tokens=100, decode_rows=0)
    model.observe_step(0.1, prompt_tokens=100, decode_rows=0)
    assert not model.step().fitted  # fewer samples than coefficients


def test_step_fit_converges_on_noisy_synthetic_steps():
    # Steps of a machine doing 2 ms + 0.1 ms a prompt token + 0.5 ms a decode row, with 5%
    # noise, over mixed batches (prefill chunks, decode-only steps, both).
    rng = random.Random(0)
    model = CostModel(token_budget=256)
    for _ in range(400):
        p = rng.choice((0, 0, rng.randrange(1, 257)))
        r = rng.randrange(0 if p else 1, 33)
        seconds = (2e-3 + 1e-4 * p + 5e-4 * r) * rng.uniform(0.95, 1.05)
        model.observe_step(seconds, p, r)
    c = model.step()
    assert c.fixed_s == pytest.approx(2e-3, rel=0.1)
    assert c.token_s == pytest.approx(1e-4, rel=0.05)
    assert c.row_s == pytest.approx(5e-4, rel=0.05)


def test_fit_follows_a_change_of_rate():
    fit = LinearFit(2, half_life=16)
    for n in range(1, 101):
        fit.observe((1.0, float(n % 10 + 1)), 0.001 * (n % 10 + 1))  # 1 ms a unit
    assert fit.coefficients()[1] == pytest.approx(1e-3, rel=1e-3)
    for n in range(1, 201):
        fit.observe((1.0, float(n % 10 + 1)), 0.003 * (n % 10 + 1))  # now 3 ms a unit
    assert fit.coefficients()[1] == pytest.approx(3e-3, rel=1e-3)


def test_coefficients_never_go_negative():
    # Timings that fall as tokens rise (noise, warm-up) would give a negative slope:
    # it is held at 0 and the intercept refitted alone.
    fit = LinearFit(2)
    for n, y in ((10, 0.05), (20, 0.04), (30, 0.03), (40, 0.03)):
        fit.observe((1.0, float(n)), y)
    fixed, slope = fit.coefficients()
    assert slope == 0.0 and fixed == pytest.approx(0.0375, rel=0.01)  # their (weighted) mean
    with pytest.raises(ValueError):
        fit.observe((1.0,), 0.1)


def test_fetch_fit_per_tier():
    model = CostModel()
    for n in (1, 2, 4, 8, 16):
        model.observe_fetch("remote", 1e-3 + n * 2**20 * 1e-9, n * 2**20)  # 1 ms + 1 ns a byte
        model.observe_fetch("host", n * 2**20 * 1e-10, n * 2**20)
    model.observe_fetch("remote", 0.5, 0)  # nothing fetched: not a sample
    fetch = model.fetch()
    assert list(fetch) == ["host", "remote"]
    assert fetch["remote"].fixed_s == pytest.approx(1e-3, rel=1e-3)
    assert fetch["remote"].byte_s == pytest.approx(1e-9, rel=1e-3)
    assert fetch["host"].fetch_s(2**20) == pytest.approx(2**20 * 1e-10, rel=1e-3)
    assert FetchCost(1.0, 1.0).fetch_s(0) == 0.0


def test_prefill_is_chunked_and_the_running_batch_rides_along():
    c = StepCost(fixed_s=0.002, token_s=0.0001, row_s=0.0005, token_budget=100)
    assert c.prefill_s(0) == 0.0
    assert c.prefill_s(250, decode_rows=4) == pytest.approx(3 * (0.002 + 0.002) + 0.025)
    # The first token: the step in flight, the queue ahead, then at least one token of its own.
    assert c.first_token_s(0, 0, running=0) == pytest.approx(0.002 + 0.0001)
    assert c.first_token_s(150, 50, running=4) == pytest.approx(
        (0.002 + 0.002) + 2 * (0.002 + 0.002) + 0.02
    )
    assert c.queue_wait_s(150, running=4) == pytest.approx(0.004 + 2 * 0.004 + 0.015)
    assert c.prefill_tokens_per_s == pytest.approx(100 / (0.002 + 0.01))
