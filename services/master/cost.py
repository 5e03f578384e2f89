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

import numpy as np

from rtp_serve.core.cost_model import TIER_HOST, TIER_REMOTE, TIER_TRANSFER, FetchCost, StepCost
from rtp_serve.services.common.pb import events_pb2
from rtp_serve.services.master.load_table import Loads

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


def decode_rows(report: events_pb2.LoadReport | None, pending_requests: int) -> tuple[int, int]:
    """A PD decode candidate's batch with this request in it, and how many requests (this
    one the last) would wait there for a slot: those running and waiting there as last
    reported, plus `pending_requests` routed there since, at most its max_num_seqs in a
    batch (0: not said, unbounded). Waiting for a slot is waiting for a stream there to
    end, which no step cost prices: the policies rank a candidate that would make the
    request wait after those that would not."""
    ahead = pending_requests + 1
    if report is not None:
        ahead += report.num_running + report.num_waiting
    limit = report.max_num_seqs if report is not None else 0
    if limit <= 0 or ahead <= limit:
        return ahead, 0
    return limit, ahead - limit


def describe_slots(over: int) -> str:
    """`over` from decode_rows, for a plan's reason."""
    return "a slot free" if over <= 0 else f"batch full, {over} to wait for a slot"


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


# -- the same, for every candidate at once -------------------------------------------------
# Over columns of candidates (services/master/load_table.py: Loads). Each expression is the
# scalar one above, operation for operation, so that the seconds are the same doubles and
# the policies choose exactly what the scalar path chooses (tests/test_policy_fast.py).


@dataclass(slots=True)
class Steps:
    """Each candidate's step model: its own where fitted, else the borrowed mean."""

    fixed_s: np.ndarray
    token_s: np.ndarray
    row_s: np.ndarray
    token_budget: np.ndarray
    step_run: np.ndarray  # step_s(0, running): a step of its running batch
    in_flight: np.ndarray  # step_run where something runs, else 0
    borrowed: StepCost  # what the unfitted ones borrow (TOKEN_UNITS: costs in tokens)
    own: np.ndarray  # bool: fitted itself

    @classmethod
    def of(cls, loads: Loads) -> Steps:
        own = loads.fitted != 0
        if own.all():
            return cls(loads.step_fixed, loads.step_token, loads.step_row, loads.budget,
                       loads.step_run, loads.in_flight, StepCost(), own)  # fmt: skip
        n = int(own.sum())
        if n == 0:
            borrowed = TOKEN_UNITS
        else:  # mean_cost: Python's sum, in the candidates' order (the same double)
            borrowed = StepCost(
                sum(loads.step_fixed[own].tolist()) / n,
                sum(loads.step_token[own].tolist()) / n,
                sum(loads.step_row[own].tolist()) / n,
                max(loads.budget[own].tolist()),
            )
        b, running = borrowed, loads.running
        step_run = np.where(own, loads.step_run, b.fixed_s + b.token_s * 0 + b.row_s * running)
        return cls(
            np.where(own, loads.step_fixed, b.fixed_s),
            np.where(own, loads.step_token, b.token_s),
            np.where(own, loads.step_row, b.row_s),
            np.where(own, loads.budget, b.token_budget),
            step_run,
            np.where(running > 0, step_run, 0.0),
            borrowed,
            own,
        )

    @property
    def in_tokens(self) -> bool:
        return self.borrowed is TOKEN_UNITS and not self.own.any()

    def step(self, i: int) -> StepCost:
        """Candidate `i`'s model as the scalar functions take it."""
        if not self.own[i]:
            return self.borrowed
        return StepCost(float(self.fixed_s[i]), float(self.token_s[i]), float(self.row_s[i]),
                        int(self.token_budget[i]))  # fmt: skip

    def step_s(self, rows: np.ndarray | int) -> np.ndarray:
        """StepCost.step_s(0, rows)."""
        return self.fixed_s + self.token_s * 0 + self.row_s * rows

    def prefill_s(self, tokens: np.ndarray, step_s: np.ndarray) -> np.ndarray:
        """StepCost.prefill_s(tokens, rows) for tokens > 0, given step_s(0, rows)."""
        budget = self.token_budget
        if (budget > 0).all():
            steps = np.ceil(tokens / budget)
        else:
            steps = np.where(budget > 0, np.ceil(tokens / np.where(budget > 0, budget, 1)), 1.0)
        return steps * step_s + self.token_s * tokens


def predict_seconds(
    loads: Loads,
    steps: Steps,
    num_prompt_tokens: int,
    local_blocks: np.ndarray | None,
    host_blocks: np.ndarray | None,
    reachable_blocks: int,
) -> np.ndarray:
    """`predict(...).seconds` of every candidate (with `loads.pending_tokens` pending);
    None for `local_blocks` and `host_blocks`: 0 everywhere."""
    queued = loads.queued + loads.pending_tokens
    remote = loads.remote_fetch != 0
    if local_blocks is None and host_blocks is None and not (reachable_blocks and remote.any()):
        # Nothing in any candidate's tiers, nothing to fetch: every prompt token computed.
        computed, fetch_s = max(1, num_prompt_tokens), None
    else:
        if local_blocks is None:
            local_blocks = np.zeros(len(queued), dtype=np.int64)
        if host_blocks is None:
            host_blocks = np.zeros(len(queued), dtype=np.int64)
        bs, kvb = loads.block_size, loads.kv_block_bytes
        full = num_prompt_tokens // bs
        local = np.minimum(local_blocks, full)
        host = np.minimum(host_blocks, full - local)
        # The remote segment counts only where the host segment did not stop the walk (a
        # tier not timed yet stops it: what follows is computed).
        fetched_remote = np.maximum(0, np.minimum(reachable_blocks, full) - local - host_blocks)
        host_fitted = loads.host_fitted != 0
        use_host = (host > 0) & host_fitted
        use_remote = remote & (fetched_remote > 0) & ~((host > 0) & ~host_fitted)
        fetched = np.where(use_host, host, 0) + np.where(use_remote, fetched_remote, 0)
        fetch_s = np.where(use_host, loads.host_fixed + loads.host_byte * (host * kvb), 0.0)
        remote_s = loads.remote_fixed + loads.remote_byte * (fetched_remote * kvb)
        fetch_s = np.where(use_remote, fetch_s + remote_s, fetch_s)
        computed = np.maximum(1, num_prompt_tokens - (local + fetched) * bs)
    seconds = steps.in_flight + steps.prefill_s(queued + computed, steps.step_run)
    return seconds if fetch_s is None else seconds + fetch_s


def lora_swap_seconds(steps: Steps, cold: np.ndarray) -> np.ndarray:
    """`lora_swap` of every candidate: where `cold` (the adapter not resident), else 0."""
    tokens = np.full(len(cold), LORA_SWAP_TOKENS)
    return np.where(cold, steps.prefill_s(tokens, steps.step_s(0)), 0.0)


def decode_rows_all(loads: Loads) -> tuple[np.ndarray, np.ndarray]:
    """`decode_rows(...)` of every candidate: (rows, waiting for a slot)."""
    ahead = loads.pending_requests + 1 + (loads.running + loads.waiting)
    limit = loads.max_seqs
    over = np.where((limit > 0) & (ahead > limit), ahead - limit, 0)
    return ahead - over, over


def decode_seconds(
    loads: Loads, steps: Steps, rows: np.ndarray, num_prompt_tokens: int, local_blocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`decode_cost(...)`'s (seconds, transferred_blocks) of every candidate."""
    blocks = np.maximum(0, -(-num_prompt_tokens // loads.block_size) - local_blocks)
    nbytes = blocks * loads.kv_block_bytes
    fitted = (loads.transfer_fitted != 0) & (nbytes > 0)
    transfer = np.where(fitted, loads.transfer_fixed + loads.transfer_byte * nbytes, 0.0)
    if steps.in_tokens:
        return rows.astype(np.float64), blocks
    return transfer + steps.step_s(rows), blocks
