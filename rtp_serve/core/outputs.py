"""A sampled token and its log-probabilities: what every hop from worker to client carries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probability of a sampled token and the top-n alternatives (id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None
