"""How long work takes here, fitted online from this worker's own measurements.

Two linear models, each refitted as measurements arrive (least squares with forgetting, so
the recent past weighs most and a change of load or machine shows within a few dozen
samples):

    step_s  ~  fixed_s + token_s * prompt_tokens + row_s * decode_rows     every engine step
    fetch_s ~  fixed_s + byte_s * bytes                                    each tier fetch

A request's time to first token then follows (`StepCost.prefill_s`): its prompt, and the
prompt tokens queued before it, are computed in chunks of at most `token_budget` tokens,
one chunk a step, while the running requests decode in every step.

Workers publish the coefficients in their LoadReports and the master predicts with these
same formulas (services/master/cost.py): every master replica, seeing the same reports,
predicts the same. Nothing here is a constant: before enough samples arrive a model is
unfitted (all zeros), and callers say "unknown". Torch-free: the master imports it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

# The tiers a worker fetches KV from (also the `tier` label of its prefix-cache metrics).
TIER_HOST, TIER_REMOTE = "host", "remote"
# KV a PD decode worker receives from the prefill worker (timed like a fetch, per byte).
TIER_TRANSFER = "transfer"
HALF_LIFE = 64.0  # samples: one this many samples old weighs half as much as the newest
_RIDGE = 1e-9  # on the unit-diagonal system: only degenerate directions feel it


class LinearFit:
    """y ~ x . theta with theta >= 0, by exponentially forgotten least squares.

    Keeps A = sum w_i x_i x_i^T and b = sum w_i x_i y_i (w_i halving every HALF_LIFE
    samples) and solves A theta = b on demand. A coefficient the data would make negative
    is fixed at 0 and the rest refitted (a step never takes less time for more work).
    Thread-safe: the engine thread observes while the event loop reads.
    """

    def __init__(self, num_features: int, half_life: float = HALF_LIFE) -> None:
        self.n = num_features
        self._decay = 0.5 ** (1.0 / half_life)
        self._a = [[0.0] * num_features for _ in range(num_features)]
        self._b = [0.0] * num_features
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, x: Sequence[float], y: float) -> None:
        if len(x) != self.n:
            raise ValueError(f"expected {self.n} features, got {len(x)}")
        if not math.isfinite(y) or y < 0:
            return
        d = self._decay
        with self._lock:
            for i in range(self.n):
                row = self._a[i]
                for j in range(self.n):
                    row[j] = d * row[j] + x[i] * x[j]
                self._b[i] = d * self._b[i] + x[i] * y
            self.count += 1

    def coefficients(self) -> tuple[float, ...]:
        """The fitted theta (all 0 until `n` samples have arrived)."""
        with self._lock:
            if self.count < self.n:
                return (0.0,) * self.n
            a = [row[:] for row in self._a]
            b = self._b[:]
        free = list(range(self.n))
        while free:
            theta = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
            worst = min(range(len(free)), key=lambda k: theta[k])
            if theta[worst] >= 0:
                out = [0.0] * self.n
                for k, i in enumerate(free):
                    out[i] = theta[k]
                return tuple(out)
            free.pop(worst)
        return (0.0,) * self.n


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b for a small symmetric positive semi-definite a, by Gaussian elimination
    with partial pivoting. Features differ by orders of magnitude (1 against bytes), so the
    system is first scaled to a unit diagonal, then ridge-regularised: a feature never seen
    (zero diagonal) gets 0."""
    n = len(b)
    d = [math.sqrt(a[i][i]) if a[i][i] > 0 else 0.0 for i in range(n)]
    m = [
        [a[i][j] / (d[i] * d[j]) if d[i] and d[j] else 0.0 for j in range(n)]
        + [b[i] / d[i] if d[i] else 0.0]
        for i in range(n)
    ]
    for i in range(n):
        m[i][i] += _RIDGE
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        s = m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))
        x[i] = s / m[i][i]
    return [x[i] / d[i] if d[i] else 0.0 for i in range(n)]


@dataclass(frozen=True, slots=True)
class StepCost:
    """A step computing p prompt tokens while r requests decode takes about
    fixed_s + token_s * p + row_s * r seconds (all 0: not fitted yet)."""

    fixed_s: float = 0.0
    token_s: float = 0.0
    row_s: float = 0.0
    token_budget: int = 0  # prompt tokens one step computes at most (0: no limit)

    @property
    def fitted(self) -> bool:
        return self.fixed_s > 0 or self.token_s > 0

    def step_s(self, prompt_tokens: int = 0, decode_rows: int = 0) -> float:
        return self.fixed_s + self.token_s * prompt_tokens + self.row_s * decode_rows

    def decode_step_s(self, running: int) -> float:
        """Seconds of a decode-only step of the running batch (at least one request; 0 if
        unfitted): what load reports and Stats publish."""
        return self.step_s(0, max(1, running)) if self.fitted else 0.0

    def prefill_s(self, tokens: int, decode_rows: int = 0) -> float:
        """Seconds to compute `tokens` prompt tokens, a chunk of at most token_budget a
        step, while `decode_rows` requests decode in every one of those steps."""
        if tokens <= 0:
            return 0.0
        steps = math.ceil(tokens / self.token_budget) if self.token_budget else 1
        return steps * self.step_s(0, decode_rows) + self.token_s * tokens

    def first_token_s(self, queued_tokens: int, own_tokens: int, running: int) -> float:
        """Time to first token of a request arriving now: the step in flight (if any
        request runs), then the prompt tokens queued before it and its own, chunked.
        A request with nothing to compute still needs one step for its first token."""
        in_flight = self.step_s(0, running) if running else 0.0
        return in_flight + self.prefill_s(queued_tokens + max(1, own_tokens), running)

    def queue_wait_s(self, queued_tokens: int, running: int) -> float:
        """Seconds before a request arriving now gets its first step (0 if unfitted)."""
        if not self.fitted:
            return 0.0
        in_flight = self.step_s(0, running) if running else 0.0
        return in_flight + self.prefill_s(queued_tokens, running)

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt throughput of full chunks with nothing decoding (0: unfitted)."""
        chunk = self.token_budget or 512
        seconds = self.prefill_s(chunk)
        return chunk / seconds if self.fitted and seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class FetchCost:
    """Fetching n bytes from one tier takes about fixed_s + byte_s * n (0s: not fitted)."""

    fixed_s: float = 0.0
    byte_s: float = 0.0

    @property
    def fitted(self) -> bool:
        return self.fixed_s > 0 or self.byte_s > 0

    def fetch_s(self, num_bytes: int) -> float:
        return self.fixed_s + self.byte_s * num_bytes if num_bytes > 0 else 0.0


class CostModel:
    """The engine's fits: one for its steps, one per tier it fetches KV from."""

    def __init__(self, token_budget: int = 0) -> None:
        self.token_budget = token_budget
        self._step = LinearFit(3)
        self._fetch: dict[str, LinearFit] = {}
        self._fetch_lock = threading.Lock()

    def observe_step(self, seconds: float, prompt_tokens: int, decode_rows: int) -> None:
        if seconds > 0 and (prompt_tokens or decode_rows):
            self._step.observe((1.0, float(prompt_tokens), float(decode_rows)), seconds)

    def observe_fetch(self, tier: str, seconds: float, num_bytes: int) -> None:
        if seconds <= 0 or num_bytes <= 0:
            return
        with self._fetch_lock:
            fit = self._fetch.setdefault(tier, LinearFit(2))
        fit.observe((1.0, float(num_bytes)), seconds)

    def step(self) -> StepCost:
        fixed, token, row = self._step.coefficients()
        return StepCost(fixed, token, row, self.token_budget)

    def fetch(self) -> dict[str, FetchCost]:
        with self._fetch_lock:
            fits = dict(self._fetch)
        return {tier: FetchCost(*fit.coefficients()) for tier, fit in sorted(fits.items())}


def local_prefill_threshold(
    prefill_tokens_per_s: float,
    transfer: FetchCost,
    kv_bytes_per_token: float,
    decode_rows: int = 1,
) -> int | None:
    """Conditional disaggregation's break-even (the master's --max-local-prefill-tokens):
    the prompt length at which moving a prompt's KV costs less than computing it on the
    decode worker. With P the decode worker's prefill rate, the hand-off's fit
    L + bytes * byte_s (`transfer`: a decode worker's "transfer" fit) and b bytes of KV a
    token:

        local:   the decode batch stalls n / P, felt by each of its `decode_rows` streams
        remote:  this request's second token waits L + n * b * byte_s for its KV

        local while  rows * n / P  <  L + n * b * byte_s,  i.e.  n < L / (rows / P - b * byte_s)

    Returns that n, rounded up (0: every prompt to a prefill worker), or None when the link
    moves a token's KV no faster than the decode worker computes it (remote never pays:
    every prompt local). The prefill worker's own time and queue are left out (it computes
    the prompt either way), and so is the network's slow start: L is what the fit saw."""
    if prefill_tokens_per_s <= 0 or kv_bytes_per_token <= 0 or decode_rows < 1:
        raise ValueError("need a positive prefill rate, KV bytes per token and decode rows")
    if not transfer.fitted:
        raise ValueError("the transfer is not fitted yet")
    saved_per_token = decode_rows / prefill_tokens_per_s - kv_bytes_per_token * transfer.byte_s
    if saved_per_token <= 0:
        return None
    return math.ceil(transfer.fixed_s / saved_per_token)
