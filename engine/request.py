"""The one mutable, engine-side request object the scheduler owns.

`num_computed_tokens` catches up with `len(token_ids)`: a prompt chunk, a prefix-cache hit,
a decode step and a recompute after preemption are all the same rule. At a decode step the
last token (just sampled) is the only one without KV, so num_computed = len(token_ids) - 1.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams
from services.common.block_hash import BlockHash, block_hash_keys


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

_arrival_counter = itertools.count()


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of a sampled token and the top-n alternatives (id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    hash_extra: bytes = b""
    priority: int = 0  # lower runs first; FCFS within a level
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 until then
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    generator: torch.Generator | None = None
    stop_reason: int | None = None
    # PD prefill side: when the request finishes, hand back the KV of prompt positions from
    # here on (None: don't). Blocks the decode side already caches are skipped.
    export_kv_from: int | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self._extend_hashes()
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            self._extend_hashes()

    def _extend_hashes(self) -> None:
        done = len(self.block_hashes)
        parent = self.block_hashes[-1] if done else None
        self.block_hashes.extend(
            block_hash_keys(
                self.token_ids, self.block_size, self.hash_extra, parent, done * self.block_size
            )
        )
