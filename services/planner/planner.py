"""One planning interval: observe, predict, size, decide, act, and say why.

    Observer.window() ---> arrivals/s, lengths, TTFT/ITL p95, requests waiting
        |                      |
        |                  predictor (Holt | last) -> next interval's arrivals/s
        v                      v
    LoadReports -----> WorkerModel per role (fitted step cost x correction)
                               |
                     sizing.size_* -> workers wanted per role
                               |
                     Scaler.decide -> targets (bounds, steps, cool-down, zero)
                               |
                     Actuator.scale(role, target, least-loaded first)

Demand is sized on max(forecast, what the last interval saw): the predictor looks ahead on a
ramp, the observation keeps a burst the trend has not caught up with from being undersized.
The corrections are learnt only from intervals whose worker counts did not change and that
saw enough first tokens: the ratio of the measured p95 to the one predicted for the workers
that ran, damped (square root) and bounded.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace

from rtp_serve.core.cost_model import StepCost
from rtp_serve.services.planner import sizing
from rtp_serve.services.planner.actuator import Actuator
from rtp_serve.services.planner.predictor import Ewma, Predictor
from rtp_serve.services.planner.scaler import Decision, Scaler
from rtp_serve.services.planner.signals import Observer, Window

log = logging.getLogger(__name__)

MIN_SAMPLES = 20  # first tokens in a window before its p95 teaches the correction
CORRECTION_BOUNDS = (0.5, 4.0)
DEFAULT_PROMPT_TOKENS = 512.0  # before any request finished
DEFAULT_OUTPUT_TOKENS = 128.0


@dataclass(slots=True)
class Step:
    """What one interval saw and did (logged, exported, and kept by benchmarks)."""

    at: float
    window: Window | None
    forecast: float
    demand: sizing.Demand
    wanted: dict[str, int]
    current: dict[str, int]
    decision: Decision
    sizings: dict[str, sizing.Sizing]
    corrections: tuple[float, float]


@dataclass
class Planner:
    observer: Observer
    actuator: Actuator
    scaler: Scaler
    predictor: Predictor
    targets: sizing.Targets
    fallback_step: StepCost  # a worker's step cost until one reports its own
    max_num_seqs: int = 64
    prompts: Ewma = field(default_factory=Ewma)
    outputs: Ewma = field(default_factory=Ewma)
    prefill_correction: float = 1.0
    decode_correction: float = 1.0
    history: list[Step] = field(default_factory=list)
    _known: dict[str, StepCost] = field(default_factory=dict)
    _last_counts: dict[str, int] | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        return self.scaler.roles

    def model(self, role: str) -> sizing.WorkerModel:
        step = self.observer.step_cost(role)
        if step is not None:
            self._known[role] = step
        step = self._known.get(role, self.fallback_step)
        return sizing.WorkerModel(
            step, self.max_num_seqs, self.prefill_correction, self.decode_correction
        )

    def demand(self, window: Window | None) -> tuple[float, sizing.Demand]:
        if window is not None and window.arrivals > 0 and window.arrived_prompt_tokens > 0:
            # Prompts are known on arrival: a burst of long ones is sized for at once.
            self.prompts.observe(window.arrived_prompt_tokens / window.arrivals)
        elif window is not None and window.finished > 0:  # a frontend without the counter
            self.prompts.observe(window.prompt_tokens / window.finished)
        if window is not None and window.finished > 0:
            self.outputs.observe(window.output_tokens / window.finished)
        observed = window.rate if window is not None else 0.0
        if window is not None:
            self.predictor.observe(observed)
        forecast = self.predictor.forecast()
        return forecast, sizing.Demand(
            rate=max(forecast, observed),
            prompt_tokens=self.prompts.value or DEFAULT_PROMPT_TOKENS,
            output_tokens=self.outputs.value or DEFAULT_OUTPUT_TOKENS,
        )

    def size(self, demand: sizing.Demand, limit: int) -> dict[str, sizing.Sizing]:
        if self.roles == ("fused",):
            return {"fused": sizing.size_fused(self.model("fused"), demand, self.targets, limit)}
        decode = sizing.size_decode(self.model("decode"), demand, self.targets, limit)
        prefill = sizing.size_prefill(
            self.model("prefill"), demand, self.targets, decode.itl_s, limit
        )
        return {"prefill": prefill, "decode": decode}

    def learn(self, window: Window | None, current: dict[str, int]) -> None:
        """Update the corrections from an interval that ran on unchanged workers."""
        steady = self._last_counts == current and all(current.get(r, 0) > 0 for r in self.roles)
        self._last_counts = dict(current)
        if window is None or not steady or window.ttft_count < MIN_SAMPLES or window.seconds <= 0:
            return
        seen = sizing.Demand(
            window.rate,
            self.prompts.value or DEFAULT_PROMPT_TOKENS,
            self.outputs.value or DEFAULT_OUTPUT_TOKENS,
        )
        predicted = self._at_counts(seen, current)
        if predicted is None:
            return
        ttft, itl = predicted
        if ttft > 0 and not math.isinf(ttft) and not math.isnan(window.ttft_p95_s):
            self.prefill_correction = _nudge(self.prefill_correction, window.ttft_p95_s / ttft)
        if itl > 0 and not math.isinf(itl) and not math.isnan(window.itl_p95_s):
            self.decode_correction = _nudge(self.decode_correction, window.itl_p95_s / itl)

    def _at_counts(self, d: sizing.Demand, counts: dict[str, int]) -> tuple[float, float] | None:
        """Predicted (ttft p95, itl) for exactly `counts` workers."""
        if self.roles == ("fused",):
            n = counts["fused"]
            s = sizing.size_fused(self.model("fused"), d, _unmeetable(self.targets), n)
            return (s.ttft_p95_s, s.itl_s) if s.workers == n else None
        dec = sizing.size_decode(
            self.model("decode"), d, _unmeetable(self.targets), counts["decode"]
        )
        pre = sizing.size_prefill(
            self.model("prefill"), d, _unmeetable(self.targets), dec.itl_s, counts["prefill"]
        )
        return pre.ttft_p95_s, dec.itl_s

    async def step(self) -> Step:
        now = time.monotonic()
        window = await self.observer.window()
        current = await self.actuator.replicas()
        current = {r: current.get(r, 0) for r in self.roles}
        self.learn(window, current)
        forecast, demand = self.demand(window)
        sizings = self.size(demand, self.scaler.limits.max_workers)
        wanted = {r: s.workers for r, s in sizings.items()}
        waiting = window.waiting_for_workers if window is not None else 0.0
        active = waiting > 0 or (window is not None and window.arrivals > 0)
        decision = self.scaler.decide(now, current, wanted, active)
        for role, target in decision.changes(current).items():
            await self.actuator.scale(role, target, self.observer.least_loaded(role))
        step = Step(now, window, forecast, demand, wanted, current, decision, sizings,
                    (self.prefill_correction, self.decode_correction))  # fmt: skip
        self.history.append(step)
        log.log(
            logging.INFO if decision.changes(current) else logging.DEBUG,
            "plan: %s | rate=%.2f/s forecast=%.2f/s prompt=%.0f output=%.0f waiting=%d "
            "ttft_p95=%s itl_p95=%s | sized %s | corrections prefill=%.2f decode=%.2f",
            decision.reason, window.rate if window else 0.0, forecast, demand.prompt_tokens,
            demand.output_tokens, waiting, _ms(window.ttft_p95_s if window else math.nan),
            _ms(window.itl_p95_s if window else math.nan),
            ", ".join(f"{r}: {s.explain()}" for r, s in sizings.items()),
            self.prefill_correction, self.decode_correction,
        )  # fmt: skip
        return step


def _unmeetable(t: sizing.Targets) -> sizing.Targets:
    """Targets no count meets: sizing then returns exactly its `limit` (the counts given)."""
    return replace(t, ttft_p95_s=-1.0, itl_p95_s=-1.0)


def _nudge(current: float, ratio: float) -> float:
    lo, hi = CORRECTION_BOUNDS
    return min(hi, max(lo, current * math.sqrt(max(ratio, 1e-6))))


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.0f}ms"
