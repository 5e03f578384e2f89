"""The frontend's metric families: per sequence (queue time, TTFT, ITL, e2e, finish) and HTTP
responses by endpoint and status."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rtp_serve.services.common.metrics import (
    ABORT,
    CLIENT_CLOSED,
    E2E_BUCKETS,
    ITL_BUCKETS,
    PREDICTION_ERROR_BUCKETS,
    QUEUE_BUCKETS,
    TTFT_BUCKETS,
    Families,
    MetricSpec,
    default_families,
)

_MODEL = ("model_name",)  # every family is per served model
_TENANT = (*_MODEL, "tenant")


class FrontendFamilies(Families):
    SPECS = (
        MetricSpec(
            "time_to_first_token", "histogram", "time_to_first_token_seconds",
            "Time from a sequence's arrival to its first output token.",
            _MODEL, TTFT_BUCKETS,
        ),
        MetricSpec(
            "ttft_prediction_error", "histogram", "ttft_prediction_error_seconds",
            "The master's predicted time from routing to the first token, subtracted from "
            "what it took (positive: slower than predicted); requests it predicted only.",
            _MODEL, PREDICTION_ERROR_BUCKETS,
        ),
        # The signed histogram has negative buckets, and a histogram with those exports no
        # _sum: this one gives the mean absolute error (its _sum over its _count).
        MetricSpec(
            "ttft_prediction_abs_error", "histogram", "ttft_prediction_abs_error_seconds",
            "How far the master's predicted time from routing to the first token was from "
            "what it took, either way; requests it predicted only.",
            _MODEL, TTFT_BUCKETS,
        ),
        MetricSpec(
            "inter_token_latency", "histogram", "inter_token_latency_seconds",
            "Time between consecutive output tokens (one observation per token after the "
            "first; tokens arriving together share the gap).",
            _MODEL, ITL_BUCKETS,
        ),
        MetricSpec(
            "e2e_request_latency", "histogram", "e2e_request_latency_seconds",
            "Time from a sequence's arrival to its last token, for finished sequences.",
            _MODEL, E2E_BUCKETS,
        ),
        MetricSpec(
            "request_queue_time", "histogram", "request_queue_time_seconds",
            "Time from a sequence's arrival until its worker stream is opened (routing).",
            _MODEL, QUEUE_BUCKETS,
        ),
        MetricSpec(
            "ttft_worker_queue", "histogram", "ttft_worker_queue_seconds",
            "The worker's share of a sequence's time to first token spent queued: from its "
            "arrival at the worker's engine to its first scheduled step (as the worker "
            "reports it with the first token).",
            _MODEL, QUEUE_BUCKETS,
        ),
        MetricSpec(
            "ttft_worker_prefill", "histogram", "ttft_worker_prefill_seconds",
            "The worker's share of a sequence's time to first token spent computing: from "
            "its first scheduled step to its first token leaving the engine.",
            _MODEL, TTFT_BUCKETS,
        ),
        MetricSpec(
            "requests_received", "counter", "requests_received",
            "Sequences that arrived (admitted past validation and limits); the planner's "
            "arrival rate.",
            _MODEL,
        ),
        MetricSpec(
            "prompt_tokens_received", "counter", "prompt_tokens_received",
            "Prompt tokens of the sequences that arrived (counted on arrival, not at the end "
            "as rtp:prompt_tokens): the planner's prompt length before any request finished.",
            _MODEL,
        ),
        MetricSpec(
            "waiting_for_workers", "gauge", "requests_waiting_for_workers",
            "Requests held because no worker runs (scale from zero: --hold-for-workers-s).",
        ),
        MetricSpec(
            "request_success", "counter", "request_success",
            "Sequences that ended, by finished_reason (stop, length; abort: ended early).",
            (*_MODEL, "finished_reason"),
        ),
        MetricSpec(
            "prompt_tokens", "counter", "prompt_tokens",
            "Prompt tokens of finished sequences.",
            _MODEL,
        ),
        MetricSpec(
            "generation_tokens", "counter", "generation_tokens",
            "Output tokens of finished sequences.",
            _MODEL,
        ),
        MetricSpec(
            "routes", "counter", "routes",
            "Worker streams routed, by who chose the worker: master, or fallback (the "
            "frontend itself, round robin over the last membership it knows, while the "
            "master is out of reach).",
            (*_MODEL, "source"),
        ),
        MetricSpec(
            "migrations", "counter", "request_migrations",
            "Worker streams reopened on another worker after one failed (before the first "
            "token a retry; after it, the sequence resumes from its tokens so far).",
            _MODEL,
        ),
        MetricSpec(
            "migration_limit", "counter", "request_migration_limit_reached",
            "Sequences that failed because their worker failed again after --max-migrations.",
            _MODEL,
        ),
        # Per tenant (services/frontend/tenants.py): only the top tenants have a label of
        # their own, the rest share "other", so the series stay few whatever the key count.
        MetricSpec(
            "tenant_requests", "counter", "tenant_requests",
            "Requests admitted, by tenant.",
            _TENANT,
        ),
        MetricSpec(
            "tenant_tokens", "counter", "tenant_tokens",
            "Tokens by tenant and kind: prompt (counted on arrival), output (as they stream).",
            (*_TENANT, "kind"),
        ),
        MetricSpec(
            "tenant_rejections", "counter", "tenant_rejections",
            "Requests refused (429) by tenant and the limit they were over: tokens_per_minute, "
            "requests_per_minute or concurrency.",
            (*_TENANT, "limit"),
        ),
        MetricSpec(
            "tenant_time_to_first_token", "histogram", "tenant_time_to_first_token_seconds",
            "Time from a sequence's arrival to its first output token, by tenant.",
            _TENANT, TTFT_BUCKETS,
        ),
        MetricSpec(
            "tenant_inter_token_latency", "histogram", "tenant_inter_token_latency_seconds",
            "Time between consecutive output tokens, by tenant.",
            _TENANT, ITL_BUCKETS,
        ),
        MetricSpec(
            "http_requests", "counter", "http_requests",
            "HTTP requests by route and status (499: the client went away).",
            ("endpoint", "status"),
        ),
    )  # fmt: skip


@dataclass(slots=True)
class SequenceTimer:
    """The timeline of one sequence (one choice of a request) as the frontend sees it.

    arrival --started()--> worker stream open --tokens(n)...--> finished() | closed()
    |-- queue time ------|
    |-- time to first token ----------------------|-- ITL --|
    |-- e2e latency ------------------------------------------|
    """

    metrics: FrontendMetrics
    tenant: TenantMetrics | None = None  # its tenant's TTFT and ITL too
    arrival: float = field(default_factory=time.monotonic)
    opened: bool = False
    last_token: float | None = None
    done: bool = False
    routed_at: float | None = None  # when the first route with a prediction was taken
    predicted_ttft_s: float = 0.0
    routed_ttft_s: float | None = None  # from that route to the first token

    def routed(self, predicted_ttft_s: float) -> None:
        """The first attempt was routed, with this prediction of its time to first token
        (0: none); the first token will say how close it was."""
        if self.routed_at is None:
            self.routed_at, self.predicted_ttft_s = time.monotonic(), predicted_ttft_s

    def started(self) -> None:
        """The worker stream is being opened (only the first attempt counts)."""
        if not self.opened:
            self.opened = True
            self.metrics.queue_time.observe(time.monotonic() - self.arrival)

    def tokens(self, n: int) -> None:
        """`n` output tokens arrived together."""
        if n <= 0:
            return
        now = time.monotonic()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.arrival)
            if self.tenant is not None:
                self.tenant.ttft.observe(now - self.arrival)
            if self.routed_at is not None:
                self.routed_ttft_s = now - self.routed_at
            if self.routed_ttft_s is not None and self.predicted_ttft_s > 0:
                error = self.routed_ttft_s - self.predicted_ttft_s
                self.metrics.prediction_error.observe(error)
                self.metrics.prediction_abs_error.observe(abs(error))
            self.last_token, n = now, n - 1
        gap = (now - self.last_token) / n if n else 0.0
        for _ in range(n):
            self.metrics.itl.observe(gap)
            if self.tenant is not None:
                self.tenant.itl.observe(gap)
        self.last_token = now

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.arrival)
        m.families.request_success.labels(m.model_name, reason).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion_tokens)

    def closed(self) -> None:
        """The sequence's stream ended; without finished() first, it counts as aborted."""
        if not self.done:
            self.done = True
            self.metrics.families.request_success.labels(self.metrics.model_name, ABORT).inc()


class FrontendMetrics:
    """The frontend's metrics for one served model."""

    __slots__ = (
        "families",
        "model_name",
        "ttft",
        "prediction_error",
        "prediction_abs_error",
        "itl",
        "e2e",
        "queue_time",
        "worker_queue",
        "worker_prefill",
        "prompt_tokens",
        "generation_tokens",
        "migrations",
        "migration_limit",
    )

    def __init__(self, families: FrontendFamilies, model_name: str) -> None:
        self.families = families
        self.model_name = model_name
        self.ttft = families.time_to_first_token.labels(model_name)
        self.prediction_error = families.ttft_prediction_error.labels(model_name)
        self.prediction_abs_error = families.ttft_prediction_abs_error.labels(model_name)
        self.itl = families.inter_token_latency.labels(model_name)
        self.e2e = families.e2e_request_latency.labels(model_name)
        self.queue_time = families.request_queue_time.labels(model_name)
        self.worker_queue = families.ttft_worker_queue.labels(model_name)
        self.worker_prefill = families.ttft_worker_prefill.labels(model_name)
        self.prompt_tokens = families.prompt_tokens.labels(model_name)
        self.generation_tokens = families.generation_tokens.labels(model_name)
        self.migrations = families.migrations.labels(model_name)
        self.migration_limit = families.migration_limit.labels(model_name)

    def worker_split(self, queue_s: float, prefill_s: float) -> None:
        """The worker's queue and compute shares of a first token (where it measured them:
        a PD decode worker that computed no prompt reports none)."""
        if prefill_s > 0:
            self.worker_queue.observe(queue_s)
            self.worker_prefill.observe(prefill_s)

    def routed_by(self, source: str) -> None:
        self.families.routes.labels(self.model_name, source).inc()

    def sequence(self, prompt_tokens: int, tenant: TenantMetrics | None = None) -> SequenceTimer:
        """A timer for a sequence of `prompt_tokens` arriving now (of this tenant's)."""
        self.families.requests_received.labels(self.model_name).inc()
        self.families.prompt_tokens_received.labels(self.model_name).inc(prompt_tokens)
        return SequenceTimer(self, tenant)

    def tenant(self, label: str) -> TenantMetrics:
        """The metrics of a tenant label (a top tenant's name, or "other")."""
        return TenantMetrics(self.families, self.model_name, label)


class TenantMetrics:
    """One tenant label's series."""

    __slots__ = ("_rejections", "_key", "requests", "prompt_tokens", "output_tokens", "ttft", "itl")

    def __init__(self, families: FrontendFamilies, model_name: str, label: str) -> None:
        self.requests = families.tenant_requests.labels(model_name, label)
        self.prompt_tokens = families.tenant_tokens.labels(model_name, label, "prompt")
        self.output_tokens = families.tenant_tokens.labels(model_name, label, "output")
        self.ttft = families.tenant_time_to_first_token.labels(model_name, label)
        self.itl = families.tenant_inter_token_latency.labels(model_name, label)
        self._rejections = families.tenant_rejections
        self._key = (model_name, label)

    def rejected(self, limit: str) -> None:
        self._rejections.labels(*self._key, limit).inc()


def frontend(model_name: str) -> FrontendMetrics:
    return FrontendMetrics(default_families(FrontendFamilies), model_name)


def http_middleware() -> Any:
    """aiohttp middleware counting every response by route template and status. Put it
    outermost, so it sees the status that error-handling middlewares produce."""
    from aiohttp import web  # imported here: only the frontend serves HTTP

    counter = default_families(FrontendFamilies).http_requests

    @web.middleware
    async def count_responses(request: web.Request, handler: Any) -> web.StreamResponse:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            counter.labels(endpoint, str(exc.status)).inc()
            raise
        except BaseException:  # cancelled: the client went away
            counter.labels(endpoint, CLIENT_CLOSED).inc()
            raise
        counter.labels(endpoint, str(response.status)).inc()
        return response

    return count_responses
