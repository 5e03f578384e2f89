"""Speculative decoding, composed into the engine: who may speculate, how far, and what
came of it.

Before each schedule, every running request that is decoding (exactly one token without
KV) and has speculation on gets drafts from the proposer, as many as pay
at this batch size given how often its drafts have been right (engine/spec_decode/adaptive.py),
never past its max_tokens or the context limit. After the step, the accepted counts feed
that estimate and the counters. The proposer's own time is measured too (a draft model's
passes): per draft, it is part of what a draft costs. A proposer with a `timer`
(engine/spec_decode/proposer.PassTimer) times its own passes, leaving out the catch-up over a
request's whole context; the others are timed here, per call.

A request with a grammar keeps its drafts up to the first one the grammar refuses (the
matcher checks them without advancing); each draft row is then sampled under the grammar's
mask after the drafts before it (engine/grammar_masks.py), so whatever is accepted is what
the grammar allows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rtp_serve.core.cost_model import StepCost
from rtp_serve.core.sampling_params import MAX_SPECULATIVE_TOKENS
from rtp_serve.engine.request import Request, RequestStatus
from rtp_serve.engine.spec_decode.adaptive import SpecState, draft_row_cost
from rtp_serve.engine.spec_decode.proposer import Proposer
from rtp_serve.engine.spec_decode.stats import SpecCounts, SpecStats

_PASS_DECAY = 0.7  # weight of the past in the proposer's time per pass


class Speculator:
    def __init__(
        self,
        proposer: Proposer,
        num_tokens: int,
        max_model_len: int,
        adaptive: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`adaptive` False: every request proposes its k_max drafts each step. `clock`
        times the proposer."""
        if not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {num_tokens}"
            )
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.adaptive = adaptive
        self._stats = SpecStats(MAX_SPECULATIVE_TOKENS)
        self._clock = clock
        self.pass_s = 0.0  # the proposer's seconds per draft pass over the batch (decayed)

    def propose(self, running: Sequence[Request], step: StepCost) -> None:
        """Set `spec_token_ids` of every running request (empty where it does not speculate).
        `step`: the engine's fitted step time, what a draft row costs."""
        decoding: list[tuple[Request, int]] = []
        for r in running:
            r.spec_token_ids = []
            if r.status != RequestStatus.RUNNING or r.num_computed_tokens != len(r.token_ids) - 1:
                continue  # waiting for remote KV, or a prompt (a recompute) catching up
            decoding.append((r, self._k_max(r)))
        timer = getattr(self.proposer, "timer", None)
        if timer is None:
            beta = draft_row_cost(step, len(decoding), self.pass_s)
        else:
            beta = draft_row_cost(step, len(decoding), timer.pass_s, timer.prior)
        chosen: list[Request] = []
        budgets: list[int] = []
        for r, k in decoding:
            if k == 0:
                continue
            if r.spec is None or r.spec.k_max != k:
                r.spec = SpecState(k_max=k)
            # d drafts yield up to d + 1 tokens, at positions up to len(token_ids) + d - 1.
            room = min(
                r.params.max_tokens - r.num_output_tokens - 1,
                self.max_model_len - len(r.token_ids),
            )
            budget = min(
                r.spec.take_budget(beta, gate_probes=timer is not None) if self.adaptive else k,
                room,
            )
            if budget > 0:
                chosen.append(r)
                budgets.append(budget)
        if not chosen:
            return
        start = self._clock()
        proposed = self.proposer.propose(chosen, budgets)
        # A draft model drafts the batch's tokens one position a pass: max(budgets) passes.
        took = (self._clock() - start) / max(budgets)
        self.pass_s = (
            took if not self.pass_s else _PASS_DECAY * self.pass_s + (1 - _PASS_DECAY) * took
        )
        for r, budget, drafts in zip(chosen, budgets, proposed, strict=True):
            r.spec_token_ids = _within_grammar(r, list(drafts[:budget]))

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        """A verified draft of `proposed` tokens kept `accepted` of them."""
        self._stats.observe(proposed, accepted)
        if request.spec is not None:
            request.spec.observe(proposed, accepted)

    def release(self, request_id: str) -> None:
        """The request ended (finished or aborted): the proposer forgets its state."""
        self.proposer.release(request_id)

    def check_integrity(self) -> None:
        self.proposer.check_integrity()

    def stats(self) -> SpecCounts:
        return self._stats.snapshot()

    def _k_max(self, request: Request) -> int:
        k = request.params.num_speculative_tokens
        return self.num_tokens if k is None else k


def _within_grammar(request: Request, drafts: list[int]) -> list[int]:
    """The drafts up to the first one the request's grammar refuses: a refused draft and
    all after it would be verified only to be rejected."""
    if request.guide is None or not drafts:
        return drafts
    return drafts[: request.guide.matcher.validate_tokens(drafts)]
