"""Adaptive speculation length: draft only as far as it pays, per request and per batch.

A draft token is one more row in the step's forward pass. It pays when the tokens it is
expected to add outweigh what the row costs. With a (decayed) estimate alpha of how often
this request's drafts are right, k drafts yield on average

    E(k) = 1 + alpha + alpha^2 + ... + alpha^k          tokens in one step,

and the step grows by k rows. Step time is close to linear in its rows, S(R) = M + C R
(fitted online from the engine's own steps, rtp_serve/core/cost_model.py, where a verified draft
is one more decode row): M the fixed part (on a CPU, streaming the weights once), C a
row's compute. Relative to the time one token costs
without speculation, S(B) / B for a batch of B, a draft row costs

    beta = C B / (M + C B)          (about 0.15 at batch 1 on a CPU, 0.75 at batch 16)

A proposer that runs a model of its own (engine/spec_decode/draft_model.py) adds its passes: k
drafts take k of them, D seconds each for the batch (timed by engine/spec_decode/speculator.py),
so a draft costs beta + D / S(B) instead (with S(B) about 60 ms at batch 1 for smollm2-135m
on a CPU and its 2-layer draft at about 20 ms a pass, drafting pays only at a high
acceptance rate: the draft pass, not the verification row, is most of a draft's price).

So each request takes the k in [0, k_max] that maximises E(k) / (1 + beta k). When that is
0 it sits out, then tries one draft again after 1, 2, 4, 8, 16 steps, so that a request
whose text starts repeating is noticed. A proposer that finds nothing costs nothing. For a
proposer with passes of its own (a draft model) a probe is only made where drafting would
pay clearly (at least 10% more tokens per unit of time), were the drafts now right nine
times in ten (alpha 0.9): its pass at a large batch can cost about what any acceptance
returns, and there its probes (a pass and a verified row each) are a loss whenever the
drafts are not that good (measured: 12% of the decode rate at batch 16 with drafts right
5% of the time, bench/spec.py), so there the request keeps sitting out.
(An n-gram proposer always probes: it costs nothing, and its price is only ever timed on
its calls, so one slow call must not stop them for good.)
"""

from __future__ import annotations

from dataclasses import dataclass

from rtp_serve.core.cost_model import StepCost

_DECAY = 0.8  # weight of the past in a request's acceptance estimate
_MAX_PAUSE = 16
_PROBE_ALPHA = 0.9  # a probe is made only where drafts this good would pay ...
_PROBE_GAIN = 1.1  # ... at least this much (tokens per unit of time, relative to none)
# C / M until the step time is fitted. Measured on a 2-core AVX2 box (smollm2-135m,
# float32, one thread): ~15 ms a row over a ~60 ms weight pass.
_PRIOR_ROW_COST = 0.2


@dataclass(slots=True)
class SpecState:
    """One request's speculation state (engine-side, owned by its Request)."""

    k_max: int
    # Decayed counts of draft tokens accepted / tried (a token after a rejection is not
    # tried); alpha = (accepted + 1/2) / (tried + 1) starts at 1/2 and, with drafts that
    # are never right, sinks to 1/12: below what a row costs even at batch 1.
    accepted: float = 0.0
    tried: float = 0.0
    pause: int = 0  # steps left to sit out
    next_pause: int = 1
    # n-gram with advice (engine/spec_decode/ngram.py): where the advice was last matched, so the
    # next match is looked for from there on (the output follows the advice in order).
    advice_cursor: int = 0

    @property
    def alpha(self) -> float:
        return (self.accepted + 0.5) / (self.tried + 1.0)

    def take_budget(self, beta: float, gate_probes: bool = False) -> int:
        """Drafts this request should propose this step (0: sit it out). `gate_probes`: probe
        only where drafts right nine times in ten would pay."""
        if self.pause > 0:
            self.pause -= 1
            if self.pause > 0:
                return 0
            if not gate_probes or _best(_PROBE_ALPHA, self.k_max, beta)[1] >= _PROBE_GAIN:
                return 1  # back from a pause: probe with one
            self._sit_out()
            return 0
        k = best_k(self.alpha, self.k_max, beta)
        if k == 0:
            self._sit_out()
        return k

    def _sit_out(self) -> None:
        self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, _MAX_PAUSE)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.accepted = _DECAY * self.accepted + accepted
        self.tried = _DECAY * self.tried + accepted + (accepted < proposed)
        if accepted:
            self.next_pause = 1


def best_k(alpha: float, k_max: int, beta: float) -> int:
    """The k in [0, k_max] maximising E(k) / (1 + beta k); the smallest on ties."""
    return _best(alpha, k_max, beta)[0]


def _best(alpha: float, k_max: int, beta: float) -> tuple[int, float]:
    """best_k and its gain E(k) / (1 + beta k) (1 for k = 0)."""
    best, best_gain, expected, term = 0, 1.0, 1.0, 1.0
    for k in range(1, k_max + 1):
        term *= alpha
        expected += term
        gain = expected / (1.0 + beta * k)
        if gain > best_gain + 1e-9:
            best, best_gain = k, gain
    return best, best_gain


def draft_row_cost(
    step: StepCost, batch: int, draft_pass_s: float = 0.0, pass_ratio_prior: float = 0.0
) -> float:
    """beta: a draft's cost relative to one token's time at this batch size: its row in the
    engine's fitted step time (rtp_serve/core/cost_model.py; a prior ratio until it is fitted),
    plus `draft_pass_s`, the proposer's own pass for the batch, over that step time (until
    both are known, `pass_ratio_prior`: the proposer's own guess of that ratio, which also
    caps a timed ratio at twice itself: a pass timed across a pause of the process says
    nothing of the next one, and with probes gated a price too high would never be
    timed again)."""
    ratio = step.row_s / step.fixed_s if step.fixed_s > 0 else _PRIOR_ROW_COST
    cb = min(ratio, 1.0) * max(batch, 1)
    beta = cb / (1.0 + cb)
    step_s = step.decode_step_s(batch)
    if draft_pass_s > 0 and step_s > 0:  # a fit whose coefficients are all held at 0 says nothing
        timed = draft_pass_s / step_s
        return beta + (min(timed, 2 * pass_ratio_prior) if pass_ratio_prior > 0 else timed)
    return beta + pass_ratio_prior
