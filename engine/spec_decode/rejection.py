"""Verifying draft tokens: the rows the target samples, and the acceptance rule.

A request with drafts d_1..d_k is run over k + 1 new tokens (its last sampled token, then
the drafts); the target's logits at row i are its distribution p_i for the token after
d_1..d_i. Row i is sampled exactly as an ordinary step at that position would be
(`DraftRow` is the request as if d_1..d_i were already appended: same min_tokens masks,
logprobs, seed and position), giving t_0..t_k. Then

    accepted = t_0 .. t_a     where d_1..d_a == t_0..t_(a-1) and d_(a+1) != t_a (or a == k)

Why this is the standard rejection rule (Leviathan et al.; Chen et al.), so the output
distribution is the target's: our drafts are deterministic given the context (n-gram
matches, greedy draft models), i.e. the draft distribution q is one-hot on d. The standard
rule accepts d with probability min(1, p(d) / q(d)) = p(d) and otherwise samples from the
residual norm(max(0, p - q)) = p with d removed, renormalised. Sampling t ~ p and accepting
iff t == d has exactly that law: P(accept) = p(d), and given t != d, t is p restricted to
the other tokens. Greedy rows are the special case t = argmax p (exact match).

Because each t_i is drawn from (seed, position) alone (engine/sampling_noise.py), the
tokens are identical with and without speculation: a seeded request gives the same output
either way, not just the same distribution. A proposer with a non-degenerate q (a sampled
draft model, EAGLE trees) would need the general rule here instead, and would give up that
identity while keeping the distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

from rtp_serve.core.outputs import SampledToken
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.structured import Guide
from rtp_serve.engine.request import Request


@dataclass(frozen=True, slots=True)
class DraftRow:
    """A request as the sampler sees it at row `offset` of its verification: after its
    first `offset` drafts. Reads like a Request where the sampler reads one."""

    request: Request
    drafts: tuple[int, ...]
    offset: int  # 1..len(drafts)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def guide(self) -> Guide | None:
        # Its mask is the grammar's after the drafts before it (engine/grammar_masks.py).
        return self.request.guide

    @property
    def sample_seed(self) -> int | None:
        return self.request.sample_seed

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + list(self.drafts[: self.offset])

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + list(self.drafts[: self.offset])

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + self.offset


def rows_of(request: Request, drafts: list[int]) -> list[Request | DraftRow]:
    """The k + 1 sampled rows of a request verifying k drafts (just itself for none)."""
    d = tuple(drafts)
    return [request, *(DraftRow(request, d, i) for i in range(1, len(d) + 1))]


def accept(drafts: list[int], sampled: list[SampledToken]) -> list[SampledToken]:
    """The longest prefix of `sampled` (k + 1 rows) that the drafts agree with, plus the
    target's own token at the first disagreement (or after the last draft)."""
    assert len(sampled) == len(drafts) + 1
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a].token_id:
        a += 1
    return sampled[: a + 1]
