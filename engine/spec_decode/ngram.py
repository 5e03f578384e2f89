"""N-gram (prompt lookup) proposer: the last n tokens, found earlier, predict what follows.

RTP-LLM's deterministic mode. A request's advice (`SamplingParams.speculative_advice`, like
RTP-LLM's sp_advice_prompt) is a text the client expects the output to repeat, such as the
file being edited: it is searched first, in order, from where it last matched. Then the
request's own prompt and output so far, the most recent match first. Longer n first: a
longer match predicts better.

    token_ids:  ... a b c x y z ... a b c | ?        suffix "a b c" (n = 3)
                    ^^^^^ match   ^^^^^ proposed: x y z ... (up to k)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rtp_serve.engine.request import Request
from rtp_serve.engine.spec_decode.adaptive import SpecState


@dataclass(frozen=True, slots=True)
class NgramProposer:
    max_n: int = 4
    min_n: int = 2  # a 1-token match is mostly chance on ordinary text

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        return [self._one(r, k) if k > 0 else [] for r, k in zip(requests, budgets, strict=True)]

    def release(self, request_id: str) -> None:
        pass  # nothing is kept per request

    def check_integrity(self) -> None:
        pass

    def _one(self, request: Request, k: int) -> list[int]:
        tokens = request.token_ids
        advice = request.params.speculative_advice
        adv = request.advice  # the same ids, made a tensor once, with the request
        state = request.spec
        hay = torch.tensor(tokens[:-1])  # windows that end before the last token
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            suffix = torch.tensor(tokens[-n:])
            if adv is not None:
                cursor = state.advice_cursor if state is not None else 0
                j = _first_match(adv, suffix, cursor)
                if j is None and cursor:
                    j = _first_match(adv, suffix, 0)
                if j is not None and j + n < len(advice):
                    _move_cursor(state, j + 1)
                    return list(advice[j + n : j + n + k])
            j = _last_match(hay, suffix)
            if j is not None:
                return tokens[j + n : j + n + k]
        return []


def _windows_equal(hay: torch.Tensor, suffix: torch.Tensor) -> torch.Tensor:
    """[len(hay) - n + 1] bool: window j of hay equals suffix."""
    n = suffix.shape[0]
    if hay.shape[0] < n:
        return torch.zeros(0, dtype=torch.bool)
    return (hay.unfold(0, n, 1) == suffix).all(dim=1)


def _first_match(hay: torch.Tensor, suffix: torch.Tensor, start: int) -> int | None:
    hits = _windows_equal(hay[start:], suffix).nonzero()
    return int(hits[0]) + start if hits.numel() else None


def _last_match(hay: torch.Tensor, suffix: torch.Tensor) -> int | None:
    hits = _windows_equal(hay, suffix).nonzero()
    return int(hits[-1]) if hits.numel() else None


def _move_cursor(state: SpecState | None, cursor: int) -> None:
    if state is not None:
        state.advice_cursor = cursor
