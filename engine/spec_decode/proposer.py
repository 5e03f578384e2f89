"""The one interface every draft-token proposer implements.

A proposer sees the running requests that may speculate this step (decoding, no grammar,
speculation on) and how many drafts each may have; it returns up to that many tokens it
guesses come next after each request's `token_ids`. It never touches KV blocks or the
scheduler: the drafts become part of the request's next step (engine/scheduler.py gives
it 1 + len(drafts) tokens), the target model computes them all in the same batched pass,
and engine/spec_decode/rejection.py keeps the longest prefix the target agrees with, plus one.

How a proposer plugs in:

* n-gram / prompt lookup (engine/spec_decode/ngram.py): pure token matching, no model.
* a draft model (engine/spec_decode/draft_model.py: a smaller model with the same tokenizer, or
  the target's first layers): runs its own forward passes over its own paged KV inside
  `propose`, k tokens autoregressively, batched over the requests; greedy drafting keeps
  every draft a function of the context, which is what the acceptance rule needs (see
  rejection.py). It keeps per-request state, which `release` frees.
* MTP / EAGLE heads: they read the target's last hidden states rather than tokens. The
  model runner would keep the final hidden state of each request's last accepted token
  (it has it in `forward` before the LM head) and hand it over with the requests; the
  head then proposes exactly like a draft model. Nothing else changes: the scheduler,
  the verification pass, the acceptance rule, rollback and metrics are shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rtp_serve.engine.request import Request


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        """Up to budgets[i] draft tokens to follow requests[i].token_ids (an empty list:
        no guess). Deterministic given the request's tokens and state."""
        ...

    def release(self, request_id: str) -> None:
        """The request ended: drop whatever is kept for it."""
        ...

    def check_integrity(self) -> None:
        """Assert the proposer's own invariants (its KV blocks, for a draft model)."""
        ...


class PassTimer:
    """A proposer that runs a model of its own times its passes with this: the decayed
    seconds of a pass in which each request computes a few tokens (a draft pass, or a
    short catch-up), not the first pass over a request's whole context, which is paid once
    and would otherwise price drafting out for every request after it. Until a pass is
    timed, `prior` is the proposer's guess of its pass over the target's decode step."""

    SHORT = 4  # tokens a request computes at most in a timed pass: weight-bound, like one
    _DECAY = 0.7

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.pass_s = 0.0  # 0: none timed yet

    def observe(self, seconds: float) -> None:
        d = self._DECAY
        self.pass_s = seconds if not self.pass_s else d * self.pass_s + (1 - d) * seconds
