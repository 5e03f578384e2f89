"""Per-tenant admission at the frontend: token buckets for tokens and requests a minute, and
a bound on requests in flight (the limits of services/frontend/tenants.py).

    arrival:  concurrency < limit?  request bucket >= 1?  token bucket >= prompt tokens?
              all yes -> take 1 request and the prompt's tokens, in flight += 1
              any no  -> 429, Retry-After: when that bucket will hold enough, naming the limit
    stream:   each output token is taken as it arrives (the bucket may go below zero: the
              tokens are made; the tenant's next request waits until they are paid back)
    end:      in flight -= 1

A bucket holds at most one minute's worth and refills continuously. A prompt larger than a
whole minute's worth is admitted once the bucket is full (it could never be otherwise).

Across frontend replicas the limits are split, not shared: with `--frontend-replicas N` each
replica enforces 1/N of every limit (at least 1 request in flight). A load balancer spreads
a tenant's requests over the replicas, so the sum holds without a shared store on the path
of every request and every streamed token; docs/features/tenants.md says why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from rtp_serve.core.tenant import TenantShare
from rtp_serve.services.frontend.errors import ErrorKind, FrontendError
from rtp_serve.services.frontend.metrics import TenantMetrics
from rtp_serve.services.frontend.tenants import TenantSpec, TenantTable

CONCURRENCY_RETRY_S = 1  # a request in flight ends in about that (no better estimate)


class TokenBucket:
    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self.rate = per_minute / 60.0  # per second
        self.level = per_minute
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, need: float, now: float) -> float:
        """Seconds until it holds `need` (capped at its capacity); 0: it does now."""
        self.refill(now)
        short = min(need, self.capacity) - self.level
        return max(0.0, short / self.rate)

    def take(self, n: float, now: float) -> None:
        self.refill(now)
        self.level -= n


@dataclass(slots=True)
class _State:
    tokens: TokenBucket | None
    requests: TokenBucket | None
    concurrency: int | None
    in_flight: int = 0


class TenantLease:
    """One admitted request of a tenant: its share (for the workers), its output tokens (as
    they stream) and its metrics. Close it when the response ends."""

    def __init__(self, limiter: TenantLimiter, spec: TenantSpec, metrics: TenantMetrics) -> None:
        self._limiter = limiter
        self.spec = spec
        self.share: TenantShare = spec.share
        self.metrics = metrics
        self._closed = False

    def output(self, n: int) -> None:
        """`n` output tokens arrived."""
        self.metrics.output_tokens.inc(n)
        self._limiter.take_output(self.spec.name, n)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._limiter.release(self.spec.name)

    def __enter__(self) -> TenantLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TenantLimiter:
    def __init__(
        self,
        table: TenantTable,
        metrics: Callable[[str], TenantMetrics],
        replicas: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`metrics(label)`: a tenant label's metrics. `replicas`: frontend replicas sharing
        the limits (each enforces 1/replicas of them)."""
        if replicas < 1:
            raise ValueError(f"frontend replicas must be >= 1, got {replicas}")
        self.table = table
        self.replicas = replicas
        self.clock = clock
        self._metrics = metrics
        self._states: dict[str, _State] = {}

    def _state(self, spec: TenantSpec) -> _State:
        state = self._states.get(spec.name)
        if state is None:
            now, n = self.clock(), self.replicas
            tpm, rpm, limit = spec.tokens_per_minute, spec.requests_per_minute, spec.concurrency
            state = self._states[spec.name] = _State(
                TokenBucket(tpm / n, now) if tpm else None,
                TokenBucket(rpm / n, now) if rpm else None,
                max(1, limit // n) if limit else None,
            )
        return state

    def admit(self, spec: TenantSpec, prompt_tokens: int) -> TenantLease:
        """Admit one request of `spec`'s tenant with this many prompt tokens, or raise the
        429 (FrontendError OVERLOADED, `retry_after` set) naming the limit it is over."""
        metrics = self._metrics(self.table.label(spec.name))
        state, now = self._state(spec), self.clock()
        refusal = None
        if state.concurrency is not None and state.in_flight >= state.concurrency:
            refusal = ("concurrency", state.concurrency, "requests in flight", CONCURRENCY_RETRY_S)
        elif state.requests is not None and (wait := state.requests.wait_s(1, now)) > 0:
            refusal = ("requests_per_minute", state.requests.capacity, "requests a minute", wait)
        elif state.tokens is not None and (wait := state.tokens.wait_s(prompt_tokens, now)) > 0:
            refusal = ("tokens_per_minute", state.tokens.capacity, "tokens a minute", wait)
        if refusal is not None:
            limit, value, unit, wait = refusal
            metrics.rejected(limit)
            raise over_limit(spec.name, limit, f"{value:g} {unit}", self.replicas, wait)
        if state.requests is not None:
            state.requests.take(1, now)
        if state.tokens is not None:
            state.tokens.take(prompt_tokens, now)
        state.in_flight += 1
        metrics.requests.inc()
        metrics.prompt_tokens.inc(prompt_tokens)
        return TenantLease(self, spec, metrics)

    def take_output(self, tenant: str, n: int) -> None:
        state = self._states[tenant]
        if state.tokens is not None:
            state.tokens.take(n, self.clock())

    def release(self, tenant: str) -> None:
        self._states[tenant].in_flight -= 1

    def in_flight(self, tenant: str) -> int:
        state = self._states.get(tenant)
        return 0 if state is None else state.in_flight


def over_limit(tenant: str, limit: str, value: str, replicas: int, wait_s: float) -> FrontendError:
    where = "" if replicas == 1 else f" on this frontend (1/{replicas} of the tenant's limit)"
    retry = max(1, math.ceil(wait_s))
    exc = FrontendError(
        ErrorKind.OVERLOADED,
        f"tenant {tenant!r} is over its {limit} limit ({value}{where}); retry after {retry} s",
        limit,
        "rate_limit_exceeded",
    )
    exc.retry_after = retry
    return exc
