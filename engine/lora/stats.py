"""What the adapter registry reports (torch-free: worker metrics read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoraStats:
    known: tuple[str, ...]
    resident: tuple[str, ...]  # least recently used first
    loads: int  # from disk, registration included
    evictions: int
    swaps: int  # loads a step needed (the adapter was evicted before), of `loads`
    max_loras: int = 0
    requests: tuple[tuple[str, int], ...] = ()  # per adapter: requests admitted (cumulative)
