"""The planner's metric families: what it wants, what runs, what it saw and did.

`rtp:planner_desired_workers{role}` is also the Kubernetes actuator: a
HorizontalPodAutoscaler reads it through the external-metrics API (deploy/k8s/planner.yaml).
"""

from __future__ import annotations

import math

from rtp_serve.services.common.metrics import Families, MetricSpec, default_families
from rtp_serve.services.planner.planner import Step


class PlannerMetrics(Families):
    SPECS = (
        MetricSpec("desired", "gauge", "planner_desired_workers",
                   "Workers the planner asks for, by role.", ("role",)),
        MetricSpec("current", "gauge", "planner_workers",
                   "Workers running (started or starting, not stopping), by role.", ("role",)),
        MetricSpec("wanted", "gauge", "planner_sized_workers",
                   "Workers the sizing arithmetic wants, before bounds, steps and cool-down.",
                   ("role",)),
        MetricSpec("scale_events", "counter", "planner_scale_events",
                   "Scale decisions carried out, by role and direction.", ("role", "direction")),
        MetricSpec("arrival_rate", "gauge", "planner_arrival_rate",
                   "Requests per second the frontends saw over the last interval."),
        MetricSpec("forecast_rate", "gauge", "planner_forecast_rate",
                   "Requests per second predicted for the next interval."),
        MetricSpec("observed_p95", "gauge", "planner_observed_p95_seconds",
                   "TTFT and ITL p95 over the last interval, as the frontends measured them.",
                   ("kind",)),
        MetricSpec("correction", "gauge", "planner_correction",
                   "Measured over predicted service time, learnt (prefill, decode).", ("kind",)),
    )  # fmt: skip

    def record(self, step: Step) -> None:
        for role, n in step.decision.targets.items():
            self.desired.labels(role).set(n)
            self.current.labels(role).set(step.current.get(role, 0))
            self.wanted.labels(role).set(step.wanted.get(role, 0))
        for role, n in step.decision.changes(step.current).items():
            direction = "up" if n > step.current.get(role, 0) else "down"
            self.scale_events.labels(role, direction).inc()
        self.forecast_rate.set(step.forecast)
        if step.window is not None:
            self.arrival_rate.set(step.window.rate)
            for kind, value in (("ttft", step.window.ttft_p95_s), ("itl", step.window.itl_p95_s)):
                if not math.isnan(value):
                    self.observed_p95.labels(kind).set(value)
        self.correction.labels("prefill").set(step.corrections[0])
        self.correction.labels("decode").set(step.corrections[1])


def planner() -> PlannerMetrics:
    return default_families(PlannerMetrics)
