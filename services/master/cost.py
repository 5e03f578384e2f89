"""The master's prediction of a request's time to first token on each candidate worker.

    predicted = wait: the step in flight there, and the prompt tokens ahead of this one
                (queued there as last reported, plus routed there since that report)
              + prefill of the prompt tokens it would compute
              + fetch of the prompt blocks it would copy from the remote tier

each term with the candidate's own coefficients, fitted online from its measurements and
published in its LoadReport (rtp_serve/core/cost_model.py: StepCost, FetchCost). Where each leading
prompt block comes from, for candidate w:

    prompt blocks  [ 0 .. local )  [ .. + host )      [ .. reachable )         [ reachable .. )
    source         w's pool (T0)   w's host tier (T1)  the remote tier (T2/T3)  computed on w
    cost           0               w's "host" fit      w's "remote" fit         w's step fit

`local` is w's match in the prefix index, `host` the match of w's host tier after it (the
index holds both tiers of every worker); `reachable`, when w reads the remote tier, is the
longer of what the cache instances hold between them, in memory (T2) or in Redis (T3) (each
publishes its part of the index, services/cache/kv_feed.py), and the longest match of any
worker's pool and host tier together: every prefill and fused worker writes the blocks it
computes back to the cache service (a cache instance that publishes no index, without
NATS, is then still counted; where a write-back was dropped, the fetch misses and the
worker computes).

A worker whose step model is not fitted yet borrows the mean coefficients of those that are;
when none is, costs are in tokens (token_s = 1) and say so. An unfitted fetch costs what
computing the blocks would: no worker wins on a fetch nobody has timed yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rtp_serve.core.cost_model import TIER_HOST, TIER_REMOTE, TIER_TRANSFER, FetchCost, StepCost
from rtp_serve.services.common.pb import events_pb2

# Costs when no candidate has a fitted model: one unit per token computed.
TOKEN_UNITS = StepCost(token_s=1.0)
# A request whose LoRA adapter is not resident on a worker first waits for it to load from
# disk (engine/lora/registry.py). Not fitted: charged as this many prompt tokens at that
# worker's own rate (a small adapter's read costs about as much on the CPUs measured).
LORA_SWAP_TOKENS = 32


def lora_swap(report: events_pb2.LoadReport | None, step: StepCost, lora: str) -> float:
    """The extra predicted cost of running under `lora` on this worker (0: resident)."""
    if not lora or (report is not None and lora in report.resident_loras):
        return 0.0
    return step.prefill_s(LORA_SWAP_TOKENS)


def step_cost(report: events_pb2.LoadReport | None) -> StepCost:
    if report is None:
        return StepCost()
    return StepCost(
        report.step_fixed_s, report.step_token_s, report.step_row_s, report.step_token_budget
    )


def fetch_cost(report: events_pb2.LoadReport | None, tier: str) -> FetchCost:
    for c in report.fetch_costs if report is not None else ():
        if c.tier == tier:
            return FetchCost(c.fixed_s, c.byte_s)
    return FetchCost()


def mean_cost(costs: Sequence[StepCost]) -> StepCost:
    """The mean coefficients of the fitted models among `costs` (TOKEN_UNITS if none)."""
    fitted = [c for c in costs if c.fitted]
    if not fitted:
        return TOKEN_UNITS
    n = len(fitted)
    return StepCost(
        sum(c.fixed_s for c in fitted) / n,
        sum(c.token_s for c in fitted) / n,
        sum(c.row_s for c in fitted) / n,
        max(c.token_budget for c in fitted),
    )


@dataclass(frozen=True, slots=True)
class Prediction:
    seconds: float  # the total (or tokens, when `in_tokens`)
    wait: float
    prefill: float
    fetch: float
    computed_tokens: int
    fetched_blocks: int
    in_tokens: bool = False

    def describe(self) -> str:
        if self.in_tokens:
            return f"{self.seconds:g} tokens"
        return (
            f"{self.seconds * 1e3:.1f} ms (wait {self.wait * 1e3:.1f} + prefill "
            f"{self.prefill * 1e3:.1f} of {self.computed_tokens} tokens + fetch "
            f"{self.fetch * 1e3:.1f} of {self.fetched_blocks} blocks)"
        )


def predict(
    report: events_pb2.LoadReport | None,
    step: StepCost,
    pending_tokens: int,
    num_prompt_tokens: int,
    block_size: int,
    local_blocks: int,
    host_blocks: int = 0,
    reachable_blocks: int = 0,
) -> Prediction:
    """Time to first token on one candidate; `step` is its own fitted model or the one it
    borrows (see the module docstring). Of the prompt's leading blocks, `local_blocks` are
    in its pool, the next `host_blocks` in its host tier, and `reachable_blocks` in all
    (counted from the first) somewhere in the cluster."""
    queued = (report.queued_tokens if report is not None else 0) + pending_tokens
    running = report.num_running if report is not None else 0
    full = num_prompt_tokens // block_size
    local = min(local_blocks, full)
    # [local, local + host) from its host tier, [.., reachable) from the remote tier; a
    # tier whose fetches have not been timed yet earns no credit.
    segments = [(TIER_HOST, min(host_blocks, full - local))]
    if report is not None and report.remote_tier:
        segments.append((TIER_REMOTE, max(0, min(reachable_blocks, full) - local - host_blocks)))
    fetched, fetch_s = 0, 0.0
    for tier, blocks in segments:
        cost = fetch_cost(report, tier)
        if blocks <= 0:
            continue
        if not cost.fitted:
            break  # counted as computed, and so is all after it
        fetched += blocks
        fetch_s += cost.fetch_s(blocks * (report.kv_block_bytes or 1))
    # At least one prompt token is always computed: its logits give the first token.
    computed = max(1, num_prompt_tokens - (local + fetched) * block_size)
    in_flight = step.step_s(0, running) if running else 0.0
    ahead = step.prefill_s(queued, running)
    total = step.first_token_s(queued, computed, running)
    return Prediction(
        seconds=total + fetch_s,
        wait=in_flight + ahead,
        prefill=total - in_flight - ahead,
        fetch=fetch_s,
        computed_tokens=computed,
        fetched_blocks=fetched,
        in_tokens=step is TOKEN_UNITS,
    )


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """A PD decode candidate's cost of taking a request, until its second token: the KV
    transfer of the prompt blocks it lacks (at its fitted receive rate) and one decode step
    of its batch with this request in it."""

    seconds: float  # or decode rows, when `in_rows` (no candidate fitted yet)
    transfer: float
    step: float
    transferred_blocks: int
    in_rows: bool = False

    def describe(self) -> str:
        if self.in_rows:
            return f"{self.seconds:g} rows"
        return (
            f"{self.seconds * 1e3:.1f} ms (transfer {self.transfer * 1e3:.1f} of "
            f"{self.transferred_blocks} blocks + step {self.step * 1e3:.1f})"
        )


def decode_cost(
    report: events_pb2.LoadReport | None,
    step: StepCost,
    rows: int,
    num_prompt_tokens: int,
    block_size: int,
    local_blocks: int,
) -> DecodeCost:
    """`rows`: requests decoding there with this one; `local_blocks`: the prompt's leading
    blocks its pool holds (the prefill worker sends only what follows them). An untimed
    transfer costs nothing: no candidate wins on a rate nobody measured."""
    blocks = max(0, -(-num_prompt_tokens // block_size) - local_blocks)
    transfer = fetch_cost(report, TIER_TRANSFER)
    transfer_s = (
        transfer.fetch_s(blocks * (report.kv_block_bytes or 1))
        if transfer.fitted and report is not None
        else 0.0
    )
    if step is TOKEN_UNITS:
        return DecodeCost(float(rows), 0.0, 0.0, blocks, in_rows=True)
    step_s = step.step_s(0, rows)
    return DecodeCost(transfer_s + step_s, transfer_s, step_s, blocks)
