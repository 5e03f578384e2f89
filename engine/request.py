"""The one mutable, engine-side request object the scheduler owns.

`num_computed_tokens` catches up with `len(token_ids)`: a prompt chunk, a prefix-cache hit,
a decode step and a recompute after preemption are all the same rule. At a decode step the
last token (just sampled) is the only one without KV, so num_computed = len(token_ids) - 1.

Speculative decoding (engine/spec_decode/) is the same rule too: a request's draft tokens
(`spec_token_ids`) are just more tokens to compute in its next step; the accepted ones
join `token_ids`, and `num_computed_tokens` advances past them only.

A PD decode request (`remote_prefill`) is the same rule with one more state: admitted, it
holds blocks for its whole prompt in WAITING_FOR_REMOTE_KV until another worker's KV and
first token arrive, then runs like any other.
"""

from __future__ import annotations

import enum
import itertools
import random
import time
from dataclasses import dataclass, field

import torch

from rtp_serve.core.block_hash import BlockHash, block_hash_keys
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.structured import Guide
from rtp_serve.core.tenant import DEFAULT_SHARE, TenantShare
from rtp_serve.engine.kv_export import KVExport
from rtp_serve.engine.outputs import StagedKV
from rtp_serve.engine.spec_decode.adaptive import SpecState


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # holds its prompt's blocks; KV comes from elsewhere
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason of a finished status; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

_arrival_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    salt: bytes = b""  # core.block_hash.cache_salt of the engine's model, KV dtype, adapter
    lora: str = ""  # the LoRA adapter it runs under (engine/lora/); "" for the base model
    priority: int = 0  # lower runs first; within a level, tenants share (engine/fair_queue.py)
    tenant: TenantShare = DEFAULT_SHARE
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    # time.monotonic() when it arrived, and when it was first admitted to run (None until
    # then): its time to first token here splits into the queue and the prefill.
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Keys of the full blocks so far. Pass the prompt's keys when this process already has
    # them (they are extended as output grows); else they are computed here.
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 until then
    num_preemptions: int = 0
    # The seed of its random draws (engine/sampling_noise.py): params.seed when given, else
    # one the engine picks (any fixed value per request keeps a draw a function of position).
    sample_seed: int | None = None
    stop_reason: int | None = None
    # When the request finishes, hand back the KV of prompt positions from here on (None:
    # don't), the part `export_kv` says (engine/kv_export.py): the PD prefill side all of
    # it past what the decode side caches; a worker writing back to the remote tier what
    # it computed, or what its prefix cache served.
    export_kv_from: int | None = None
    export_kv: KVExport = KVExport.PROMPT
    # PD decode side: the prompt is computed by another worker (see RequestStatus).
    remote_prefill: bool = False
    # Prefix KV a lower tier (the cache service) gave this request while it was queued:
    # put into the pool again right before it is admitted if evicted meanwhile, and
    # dropped then.
    staged_kv: StagedKV | None = None
    # Structured output: the request's matcher (params.structured compiled); advanced with
    # every token appended, it masks the logits and ends the request when its grammar does.
    guide: Guide | None = None
    # Speculative decoding: draft tokens proposed for the next step (the scheduler takes
    # them), and the adaptive state of this request's speculation (None: never proposed).
    spec_token_ids: list[int] = field(default_factory=list)
    spec: SpecState | None = None
    # params.speculative_advice as a tensor, built once here: the n-gram proposer searches
    # it every step (None: no advice).
    advice: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        advice = self.params.speculative_advice
        self.advice = torch.tensor(advice, dtype=torch.long) if advice else None
        if not self.block_hashes:
            self._extend_hashes()
        elif len(self.block_hashes) != len(self.token_ids) // self.block_size:
            raise ValueError(
                f"{len(self.block_hashes)} block hashes given for "
                f"{len(self.token_ids) // self.block_size} full prompt blocks"
            )
        else:
            self.block_hashes = list(self.block_hashes)  # extended below: not the caller's
        if self.params.seed is not None:
            self.sample_seed = self.params.seed
        elif self.sample_seed is None:
            self.sample_seed = random.getrandbits(63)

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
                self.token_ids, self.block_size, self.salt, parent, done * self.block_size
            )
        )
