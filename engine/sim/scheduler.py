"""The simulated engine's requests and continuous batching over the real block pool.

vLLM v1's one rule: each step a running request computes `num_tokens - num_computed` new
tokens (capped by the step's token budget): a prompt in chunks, then one token a step. When it
has caught up, a token is sampled. Waiting requests are admitted in (priority, arrival) order,
their prefix found in the pool's cache; when blocks run out, the newest running request is
preempted (its blocks freed, recomputed later). Outputs collect in `outbox`.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import time
from array import array
from dataclasses import dataclass, field
from enum import Enum

from rtp_serve.core.block_hash import BlockHash
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.engine.block_pool import BlockPool, KVBlock
from rtp_serve.engine.errors import QueueFullError
from rtp_serve.engine.kv_export import KVExport, export_range
from rtp_serve.engine.outputs import PromptKV, RequestOutput, StagedKV

_GOLDEN = 0x9E3779B97F4A7C15


class SimStatus(Enum):
    WAITING = "waiting"
    HELD = "held"  # waiting for its tier fetch (the request's prefetch)
    WAITING_FOR_KV = "waiting_for_kv"  # PD decode side: blocks reserved, KV to come
    RUNNING = "running"


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    prompt: list[int]
    hashes: list[BlockHash]  # the prompt's full-block keys
    params: SamplingParams
    priority: int = 0
    export_kv_from: int | None = None
    export_kv: KVExport = KVExport.PROMPT
    remote_prefill: bool = False
    status: SimStatus = SimStatus.WAITING
    arrival: float = field(default_factory=time.monotonic)
    seq: int = 0
    blocks: list[KVBlock] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens the prefix cache (or a tier) served
    num_hashed: int = 0  # leading blocks registered in the pool's cache
    num_output: int = 0
    staged: StagedKV | None = None
    admitted_at: float | None = None
    seed: int | None = None  # of its tokens: the prompt's hash

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.num_output

    def token(self, n: int, vocab: int, avoid: frozenset[int]) -> int:
        """The n-th output token: a function of the prompt and n only."""
        if self.seed is None:
            digest = hashlib.blake2b(array("q", self.prompt).tobytes(), digest_size=8).digest()
            self.seed = int.from_bytes(digest, "little")
        token = (self.seed + n * _GOLDEN) % vocab
        while token in avoid:
            token = (token + 1) % vocab
        return token


@dataclass(frozen=True, slots=True)
class Work:
    """One request's share of a step."""

    request: SimRequest
    num_tokens: int

    @property
    def prefill(self) -> bool:
        return self.request.num_computed < len(self.request.prompt)


class SimScheduler:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_waiting: int,
        token_budget: int,
        vocab_size: int,
        avoid_tokens: frozenset[int] = frozenset(),
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_waiting = max_num_waiting
        self.token_budget = token_budget
        self.vocab_size = vocab_size
        self.avoid = avoid_tokens
        self.requests: dict[str, SimRequest] = {}
        self.running: list[SimRequest] = []  # in admission order
        self._waiting: list[tuple[int, int, SimRequest]] = []  # heap on (priority, arrival)
        self._seq = itertools.count()
        self.outbox: list[RequestOutput] = []

    # -- queries -------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.running)

    @property
    def num_queued_tokens(self) -> int:
        return sum(
            len(r.prompt) - r.num_computed
            for r in self.requests.values()
            if not r.remote_prefill and r.num_computed < len(r.prompt)
        )

    def has_work(self) -> bool:
        return bool(self._waiting) or any(r.status == SimStatus.RUNNING for r in self.running)

    # -- commands ------------------------------------------------------------------------
    def add(self, request: SimRequest, held: bool) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} is already running here")
        if self.num_waiting >= self.max_num_waiting:
            raise QueueFullError(
                f"{self.num_waiting} requests are already waiting (max_num_waiting)"
            )
        request.seq = next(self._seq)
        self.requests[request.request_id] = request
        if held:
            request.status = SimStatus.HELD
        else:
            heapq.heappush(self._waiting, (request.priority, request.seq, request))

    def release(self, request_id: str, staged: StagedKV | None) -> None:
        request = self.requests.get(request_id)
        if request is not None and request.status == SimStatus.HELD:
            request.status, request.staged = SimStatus.WAITING, staged
            heapq.heappush(self._waiting, (request.priority, request.seq, request))

    def abort(self, request_id: str) -> SimRequest | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:  # left in the heap, skipped when it comes up
            self._waiting = [e for e in self._waiting if e[2] is not request]
            heapq.heapify(self._waiting)
        self._free(request)
        return request

    def deliver_kv(self, request_id: str, kv: list[PromptKV], first: int) -> None:
        """A WAITING_FOR_KV request's prompt KV arrived (past what it had cached)."""
        request = self.requests[request_id]
        prompt = len(request.prompt)
        if request.status != SimStatus.WAITING_FOR_KV:
            raise ValueError(f"{request_id} is not waiting for KV")
        start = kv[0].start if kv else prompt
        covered = sum(part.num_tokens for part in kv)
        if start != request.num_cached or start + covered != prompt:
            raise ValueError(
                f"KV covers [{start}, {start + covered}), expected [{request.num_cached}, {prompt})"
            )
        request.num_computed = prompt
        self._cache_blocks(request)
        request.status = SimStatus.RUNNING
        self._sampled(request, time.monotonic(), first)

    # -- the step ------------------------------------------------------------------------
    def schedule(self) -> list[Work]:
        """This step's work: the running requests first, then admitted ones."""
        budget, work = self.token_budget, []
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != SimStatus.RUNNING or request not in self.running:
                continue
            n = min(request.num_tokens - request.num_computed, budget)
            if n > 0 and self._grow(request, n):
                work.append(Work(request, n))
                budget -= n
        while budget > 0 and self._waiting and len(self.running) < self.max_num_seqs:
            request = self._waiting[0][2]
            if not self._admit(request):
                break
            heapq.heappop(self._waiting)
            if request.status == SimStatus.RUNNING:
                n = min(request.num_tokens - request.num_computed, budget)
                if not self._grow(request, n):
                    break  # preempted at once: no room for it now
                work.append(Work(request, n))
                budget -= n
        return work

    def complete(self, work: list[Work]) -> None:
        """The step ended: advance each request, sample those caught up."""
        now = time.monotonic()
        for item in work:
            request = item.request
            if self.requests.get(request.request_id) is not request:
                continue  # aborted during the step
            if request not in self.running:
                continue  # preempted during the step
            request.num_computed += item.num_tokens
            self._cache_blocks(request)
            if request.num_computed >= request.num_tokens:
                self._sampled(request, now)

    # -- internals -----------------------------------------------------------------------
    def _admit(self, request: SimRequest) -> bool:
        bs, prompt = self.block_size, len(request.prompt)
        usable = request.hashes[: (prompt - 1) // bs]  # one token is always computed
        hits: list[KVBlock] = []
        for key in usable:
            block = self.pool.get_cached(key)
            if block is None:
                break
            hits.append(block)
        staged, imported = request.staged, 0
        following = usable[len(hits) : len(hits) + len(staged.block_hashes)] if staged else []
        if staged is not None and not request.remote_prefill and staged.block_hashes == following:
            imported = len(staged.block_hashes)  # a lower tier's blocks, written here
        cached = len(hits) + imported
        # PD decode side: the whole prompt's blocks now; otherwise the imported ones (the
        # rest grow with each chunk).
        needed = -(-prompt // bs) - len(hits) if request.remote_prefill else imported
        # A cached block in the free queue counts as free: touch them first.
        self.pool.touch(hits)
        if needed > self.pool.num_free_blocks:
            self.pool.free(reversed(hits))
            return False
        request.blocks = hits + self.pool.allocate(needed)
        request.num_computed = request.num_cached = cached * bs
        request.num_hashed = len(hits)
        self._cache_blocks(request)
        request.admitted_at = time.monotonic()
        self.running.append(request)
        if request.remote_prefill:
            request.status = SimStatus.WAITING_FOR_KV
            self.outbox.append(_output(request, [], waiting_for_kv=True))
        else:
            request.status = SimStatus.RUNNING
        return True

    def _grow(self, request: SimRequest, n: int) -> bool:
        """Blocks for the request's next n tokens, preempting the newest others if needed;
        False if it was itself preempted."""
        needed = -(-(request.num_computed + n) // self.block_size) - len(request.blocks)
        while needed > self.pool.num_free_blocks:
            victim = next(
                (r for r in reversed(self.running) if r.status == SimStatus.RUNNING), None
            )
            if victim is None or victim is request:
                if victim is request:
                    self._preempt(request)
                return False
            self._preempt(victim)
        if needed > 0:
            request.blocks += self.pool.allocate(needed)
        return True

    def _preempt(self, request: SimRequest) -> None:
        self.running.remove(request)
        self._free(request)
        request.num_computed = request.num_cached = request.num_hashed = 0
        request.status = SimStatus.WAITING
        heapq.heappush(self._waiting, (request.priority, request.seq, request))

    def _free(self, request: SimRequest) -> None:
        self.pool.free(reversed(request.blocks))  # tail first: evicted before the head
        request.blocks = []

    def _cache_blocks(self, request: SimRequest) -> None:
        full = min(request.num_computed, len(request.prompt)) // self.block_size
        for i in range(request.num_hashed, min(full, len(request.hashes))):
            self.pool.cache_block(request.blocks[i], request.hashes[i])
        request.num_hashed = max(request.num_hashed, min(full, len(request.hashes)))

    def _sampled(self, request: SimRequest, now: float, token: int | None = None) -> None:
        if token is None:
            token = request.token(request.num_output, self.vocab_size, self.avoid)
        first = request.num_output == 0
        request.num_output += 1
        params = request.params
        stop = token in params.stop_token_ids and request.num_output >= params.min_tokens
        length = request.num_output >= params.max_tokens
        finished = stop or length
        out = _output(
            request,
            [token],
            finished=finished,
            reason="stop" if stop else "length" if length else None,
            stop_reason=token if stop else None,
            timing=(request.admitted_at or now, now) if first else None,
            prompt_kv=_prompt_kv(request)
            if finished and request.export_kv_from is not None
            else None,
        )
        self.outbox.append(out)
        if finished:
            del self.requests[request.request_id]
            self.running.remove(request)
            self._free(request)


def _prompt_kv(request: SimRequest) -> PromptKV | None:
    """The part of the prompt's KV the request asked for (engine/kv_export.py), None if
    empty: one float32 per token for K and V, the token id, so a receiver holds what was
    computed."""
    import numpy as np

    start, end = export_range(
        request.export_kv, request.export_kv_from or 0, request.num_cached, len(request.prompt)
    )
    if start >= end:
        return None
    tokens = np.asarray(request.prompt[start:end], dtype=np.float32).reshape(1, -1, 1, 1)
    return PromptKV(start, tokens, tokens.copy())


def _output(
    request: SimRequest,
    tokens: list[int],
    *,
    finished: bool = False,
    reason: str | None = None,
    stop_reason: int | None = None,
    waiting_for_kv: bool = False,
    timing: tuple[float, float] | None = None,
    prompt_kv: PromptKV | None = None,
) -> RequestOutput:
    queue_s = prefill_s = None
    if timing is not None:
        queue_s, prefill_s = timing[0] - request.arrival, timing[1] - timing[0]
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=tokens,
        new_logprobs=None,
        finished=finished,
        finish_reason=reason,
        num_prompt_tokens=len(request.prompt),
        num_output_tokens=request.num_output,
        num_cached_tokens=request.num_cached,
        stop_reason=stop_reason,
        prompt_kv=prompt_kv,
        waiting_for_kv=waiting_for_kv,
        queue_s=queue_s,
        prefill_s=prefill_s,
    )
