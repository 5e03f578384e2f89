"""How many workers meet the targets: queueing arithmetic over a worker's fitted step cost.

A worker's step computing p prompt tokens while r requests decode takes
f + t*p + w*r seconds (core.cost_model.StepCost: fixed_s, token_s, row_s; what every
worker fits online and publishes in its LoadReport). Demand is an arrival rate lam
(requests/s) with mean prompt tokens P and output tokens O. With n workers of a kind each
gets lam/n.

Decode (a decode worker, or a fused one's decoding rows). By Little's law a worker holds
b = (lam/n) * O * itl streams, and its step, the inter-token latency, is

    itl = (f + w*b) / (1 - rho)        rho = (lam/n) * t * P, the step time prompts take
                                               (fused only; 0 on a PD decode worker)

solved by fixed-point iteration; the worker qualifies while itl <= the ITL target and b fits
its max_num_seqs.

Prefill (a prefill worker, or a fused one's prompts). One prompt's service time is
S = ceil(P / budget) chunk steps + t*P (its tokens), each chunk step also carrying the
b decoding rows on a fused worker. Each worker is taken as an M/M/1 queue for the wait
before its prompt starts: with utilisation rho = (lam/n) * S the wait is 0 with probability
1 - rho and otherwise exponential with rate 1/S - lam/n, so P(wait > x) = rho e^-(1/S - lam/n)x
and the prompt's own service follows:

    ttft_p95 = S + max(0, ln(20 rho)) / (1/S - lam/n)

(S alone while fewer than 1 in 20 requests wait; the M/M/1 tail beyond, pessimistic for
near-constant service times, which is the side to err on). On a PD pair the first token
also needs one decode step after the KV arrives.

The corrections multiply the service times (prompts; decode steps): the ratio of what the frontend measured to what
this arithmetic predicted for the workers that ran (Dynamo's planner keeps such correction
factors too), so a model that is off is pulled back by what happened.

The smallest n that qualifies is searched upward from 1 (every quantity falls with n), up to
`limit`. None: the target cannot be met by adding workers (one prompt alone takes longer
than the TTFT target, say), and the sizing says feasible=False with the fewest workers that
come within 10% of what `limit` workers would give: past that, more workers buy nothing the
targets can see, so they are not asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rtp_serve.core.cost_model import StepCost

P95_LOG = math.log(20.0)  # -ln(1 - 0.95)
DEFAULT_TOKEN_BUDGET = 512
FIXED_POINT_ROUNDS = 50


@dataclass(frozen=True, slots=True)
class Demand:
    rate: float  # requests per second
    prompt_tokens: float  # mean prompt tokens a worker computes per request (not cached)
    output_tokens: float  # mean output tokens per request


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_p95_s: float
    itl_p95_s: float
    headroom: float = 0.8  # size for this share of each target: p95s wander around means


@dataclass(frozen=True, slots=True)
class WorkerModel:
    """One worker kind's capacity: its step cost and its batch bound."""

    step: StepCost
    max_num_seqs: int = 256
    # measured / predicted (see the module docstring): prompts, and decode steps
    prefill_correction: float = 1.0
    decode_correction: float = 1.0


@dataclass(frozen=True, slots=True)
class Sizing:
    workers: int
    feasible: bool
    ttft_p95_s: float  # predicted at `workers` (inf: over capacity)
    itl_s: float  # predicted mean inter-token latency at `workers`
    batch: float  # predicted decoding streams per worker

    def explain(self) -> str:
        mark = "" if self.feasible else " (targets out of reach)"
        return (
            f"{self.workers} workers{mark}: ttft_p95={self.ttft_p95_s:.3f}s "
            f"itl={self.itl_s * 1e3:.1f}ms batch={self.batch:.1f}"
        )


def _decode(
    model: WorkerModel, per_worker_rate: float, d: Demand, prefill_share: float
) -> tuple[float, float]:
    """(itl, batch) of a worker decoding at `per_worker_rate` arrivals; inf when prompts
    and decoding together need more than the worker's time."""
    s = model.step
    c = model.decode_correction
    if prefill_share >= 1.0:
        return math.inf, math.inf
    itl = c * (s.fixed_s + s.row_s) / (1.0 - prefill_share)
    batch = 0.0
    for _ in range(FIXED_POINT_ROUNDS):
        batch = per_worker_rate * d.output_tokens * itl
        new = c * (s.fixed_s + s.row_s * max(1.0, batch)) / (1.0 - prefill_share)
        if abs(new - itl) <= 1e-9 * max(new, 1e-9):
            itl = new
            break
        itl = new
        if itl > 1e3:  # diverging: the batch grows faster than the step time per row
            return math.inf, math.inf
    return itl, per_worker_rate * d.output_tokens * itl


def _prompt_service_s(model: WorkerModel, d: Demand, decode_rows: float) -> float:
    s = model.step
    budget = s.token_budget or DEFAULT_TOKEN_BUDGET
    chunks = max(1, math.ceil(d.prompt_tokens / budget))
    return model.prefill_correction * (chunks * s.step_s(0, 0) + s.row_s * decode_rows * chunks
                               + s.token_s * d.prompt_tokens)  # fmt: skip


def _ttft_p95(service_s: float, per_worker_rate: float) -> float:
    """The prompt's own service after the M/M/1 wait's 95th percentile."""
    if service_s <= 0:
        return 0.0
    slack = 1.0 / service_s - per_worker_rate
    if slack <= 0:
        return math.inf
    waiting = per_worker_rate * service_s  # rho: the share of arrivals that wait
    return service_s + max(0.0, P95_LOG + math.log(waiting) if waiting > 0 else 0.0) / slack


def _meets(t: Targets, ttft: float, itl: float) -> bool:
    return ttft <= t.ttft_p95_s * t.headroom and itl <= t.itl_p95_s * t.headroom


def size_fused(model: WorkerModel, d: Demand, t: Targets, limit: int) -> Sizing:
    """Fused workers: each computes its prompts and decodes them."""

    def at(n: int) -> Sizing:
        rate = d.rate / n
        prefill_share = rate * model.prefill_correction * model.step.token_s * d.prompt_tokens
        itl, batch = _decode(model, rate, d, prefill_share)
        if math.isinf(itl) or batch > model.max_num_seqs:
            return Sizing(n, False, math.inf, itl, batch)
        ttft = _ttft_p95(_prompt_service_s(model, d, batch), rate) + itl
        return Sizing(n, _meets(t, ttft, itl), ttft, itl, batch)

    return _smallest(at, d, limit)


def size_prefill(
    model: WorkerModel, d: Demand, t: Targets, decode_step_s: float, limit: int
) -> Sizing:
    """PD prefill workers: prompts only; the first token also waits one decode step
    (`decode_step_s`, the decode side's predicted step)."""

    def at(n: int) -> Sizing:
        rate = d.rate / n
        ttft = _ttft_p95(_prompt_service_s(model, d, 0.0), rate) + decode_step_s
        return Sizing(n, ttft <= t.ttft_p95_s * t.headroom, ttft, 0.0, 0.0)

    return _smallest(at, d, limit)


def size_decode(model: WorkerModel, d: Demand, t: Targets, limit: int) -> Sizing:
    """PD decode workers: the streams the prefill workers hand over."""

    def at(n: int) -> Sizing:
        itl, batch = _decode(model, d.rate / n, d, 0.0)
        ok = itl <= t.itl_p95_s * t.headroom and batch <= model.max_num_seqs
        return Sizing(n, ok, 0.0, itl, batch)

    return _smallest(at, d, limit)


def _smallest(at: Callable[[int], Sizing], d: Demand, limit: int) -> Sizing:
    if d.rate <= 0:
        return Sizing(0, True, 0.0, 0.0, 0.0)
    limit = max(1, limit)
    for n in range(1, limit + 1):
        sizing = at(n)
        if sizing.feasible:
            return sizing
    best = at(limit)
    if math.isinf(best.ttft_p95_s) or math.isinf(best.itl_s):
        return best  # over capacity even then: all of it
    for n in range(1, limit + 1):  # out of reach: the fewest within 10% of the most
        sizing = at(n)
        if sizing.ttft_p95_s <= 1.1 * best.ttft_p95_s and sizing.itl_s <= 1.1 * best.itl_s:
            return sizing
    return best
