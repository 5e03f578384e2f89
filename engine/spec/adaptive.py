"""Adaptive speculation length: each request's k follows how many of its drafts are accepted.

Every draft token is one more row in the step's forward pass. On a CPU at batch 1 a few
rows cost about one (each weight is streamed once for all of them); in a large batch they
cost compute. So a request proposes as far as its drafts have lately been right, and
backs off when they are not:

    all d accepted       k = min(k + 1, k_max)
    a < d accepted       k = max(1, a + 1)        (one past what was right)
    none, m times in a row  sit out 2^(m-1) - 1 steps (0, 1, 3, 7, then 15 at most)

A proposer that finds nothing (an n-gram without a match) costs nothing and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

_MAX_PAUSE = 15
MAX_SPECULATIVE_TOKENS = 16  # per request and per server


@dataclass(slots=True)
class SpecState:
    """One request's speculation state (engine-side, owned by its Request)."""

    k_max: int
    k: int
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left to sit out
    # n-gram with advice (engine/spec/ngram.py): where the advice was last matched, so the
    # next match is looked for from there on (the output follows the advice in order).
    advice_cursor: int = 0

    @classmethod
    def start(cls, k_max: int) -> SpecState:
        return cls(k_max=k_max, k=k_max)

    def take_budget(self) -> int:
        """Drafts this request may propose this step (0 while sitting out)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        if accepted >= proposed:
            self.k = min(self.k + 1, self.k_max)
        else:
            self.k = max(1, accepted + 1)
        if accepted == 0:
            self.misses += 1
            self.pause = min(2 ** (self.misses - 1) - 1, _MAX_PAUSE)
        else:
            self.misses = 0
