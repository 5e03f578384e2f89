"""Counters of proposed and accepted draft tokens (what the worker exports as metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SpecCounts:
    """Cumulative since start. A "draft" is one request's proposal verified in one step."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    # Position i (0-based): drafts that reached it, and how many of those were accepted.
    proposed_per_pos: tuple[int, ...]
    accepted_per_pos: tuple[int, ...]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified draft yields on average: its accepted tokens plus the target's."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_per_pos(self) -> list[float]:
        return [
            a / p if p else 0.0
            for a, p in zip(self.accepted_per_pos, self.proposed_per_pos, strict=True)
        ]


@dataclass(slots=True)
class SpecStats:
    k_max: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.proposed_per_pos = [0] * self.k_max
        self.accepted_per_pos = [0] * self.k_max

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(min(proposed, self.k_max)):
            self.proposed_per_pos[i] += 1
            self.accepted_per_pos[i] += i < accepted

    def snapshot(self) -> SpecCounts:
        return SpecCounts(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.proposed_per_pos),
            tuple(self.accepted_per_pos),
        )
