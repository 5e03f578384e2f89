"""Continuous-batching scheduler in the vLLM-v1 style.

There is no prefill or decode phase: every step each running request gets
`len(token_ids) - num_computed_tokens` new tokens (capped by the step's token budget), then
waiting requests are admitted by priority, then, within a priority class, by tenant (the
least-served by weighted tokens first, engine/fair_queue.py), then by arrival. Chunked prefill
is the budget cap, a prefix hit starts `num_computed_tokens` above zero, and preemption resets
it to zero (recompute). When blocks run out, the least urgent class's most-served tenant's
newest running request is preempted. With one tenant (or `fair` off) that is (priority,
arrival) order, and the lowest-priority, newest request is preempted. With tenants, a head
that finds no slot or blocks may also preempt (displace) an over-served tenant's running
request in its class, so a light tenant does not wait for a flood's requests to finish.

Speculative decoding adds no phase either: a decoding request's draft tokens
(`Request.spec_token_ids`, set by engine/spec_decode/speculator.py before the step) are more new
tokens, 1 + k in all, trimmed to the budget and dropped before anyone is preempted for
them. After the step `num_computed_tokens` advances past the accepted drafts only, and
the blocks that held nothing but rejected drafts go back to the pool.

A PD decode request (`remote_prefill`) queues like any other; admitted, it takes blocks for
its whole prompt and waits in WAITING_FOR_REMOTE_KV (counted as running, never computed or
preempted) until `kv_arrived` hands it the prefill worker's first token.

A request whose prefix is being fetched from a lower KV tier is added `held`: it keeps its
place in the arrival order but is not admitted until `release` (the fetch landed, or
failed), so fetching overlaps with queueing and the requests behind it go on meanwhile.
Right before a request is admitted, the `prepare` hook (the engine's) puts what the tiers
gave it back into the pool, in case it was evicted while the request waited.

A request with a grammar (`Request.guide`) advances it with every token appended here,
the first token from a prefill worker included, and stops when the grammar is complete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from rtp_serve.core.outputs import SampledToken
from rtp_serve.engine.errors import QueueFullError
from rtp_serve.engine.fair_queue import FairQueue
from rtp_serve.engine.kv_cache_manager import KVCacheManager
from rtp_serve.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_waiting: int = 256
    # Distinct LoRA adapters running at once (the resident set, engine/lora/registry.py).
    max_loras: int = 1
    # Share each priority class between tenants by weighted tokens served (VTC); False:
    # first come, first served within a class.
    fair: bool = True


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # drafts included
    # Draft tokens computed after the request's own (the last num_new_tokens are them).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step catches the request up, so its logits give the next token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == len(r.token_ids) + len(
            self.spec_token_ids
        )


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Remote-prefill requests admitted this step: their blocks wait for KV from elsewhere.
    waiting_for_kv: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        eos_token_ids: tuple[int, ...],
        prepare: Callable[[Request], None] | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prepare = prepare
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []  # RUNNING and WAITING_FOR_REMOTE_KV
        self._waiting = FairQueue(config.fair)
        self._held: dict[str, Request] = {}  # WAITING, until their tier fetch is released
        # The last schedule() did nothing: until a request arrives, leaves or gets its
        # remote KV, another one would do nothing either.
        self._stalled = False

    # -- queues ----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Waiting requests, held ones included."""
        return len(self._waiting) + len(self._held)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_schedulable(self) -> bool:
        """Whether a step could do anything now (False: everything waits for remote KV, or
        for blocks that only such requests can free)."""
        if any(r.status == RequestStatus.RUNNING for r in self.running):
            return True
        return bool(self._waiting) and not self._stalled

    def add_request(self, request: Request, held: bool = False) -> None:
        """Queue a request; `held`, it is not admitted before `release(request_id)`."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        # New arrivals only: a preempted request re-enters the queue past the bound.
        if self.num_waiting >= self.config.max_num_waiting:
            raise QueueFullError(
                f"{self.num_waiting} requests are already waiting (max_num_waiting)"
            )
        self.requests[request.request_id] = request
        self._waiting.arrive(request)
        if held:
            self._held[request.request_id] = request
            return
        self._waiting.push(request)
        self._stalled = False

    def release(self, request_id: str) -> Request | None:
        """Let a held request be admitted, in its arrival order (None: it is not held)."""
        request = self._held.pop(request_id, None)
        if request is not None:
            self._waiting.push(request)
            self._stalled = False
        return request

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request_id in self._held:
            del self._held[request_id]
        elif request.status == RequestStatus.WAITING:
            self._waiting.remove(request)
        else:
            self.running.remove(request)
        self._waiting.leave(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._stalled = False
        return request

    def kv_arrived(self, request_id: str, first: SampledToken) -> Request:
        """A remote-prefill request's prompt KV has been written: decode on after `first`."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV")
        request.num_computed_tokens = len(request.token_ids)
        self.kv.cache_blocks(request, request.num_computed_tokens)
        # From here on an ordinary request: if preempted, it is recomputed here (its KV
        # will not come again).
        request.remote_prefill = False
        request.status = RequestStatus.RUNNING
        self._stalled = False
        self._append(request, first)
        return request

    # -- one step --------------------------------------------------------------------------
    def num_decoding(self) -> int:
        """Running requests that compute one token next step (drafts aside): decode rows."""
        return sum(
            1
            for r in self.running
            if r.status == RequestStatus.RUNNING and len(r.token_ids) - r.num_computed_tokens <= 1
        )

    def schedule(self, prompt_cap: int | None = None) -> SchedulerOutput:
        """The next step. `prompt_cap`: at most this many tokens (at least 1) of requests
        catching up (a prompt, or a preempted request's recompute) within the token budget;
        decode rows do not count against it (the engine's ITL target)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        catch_up = budget if prompt_cap is None else max(1, prompt_cap)
        scheduled: dict[str, ScheduledRequest] = {}

        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop, or waiting for remote KV
            uncomputed = len(request.token_ids) - request.num_computed_tokens
            limit = budget if uncomputed <= 1 else min(budget, catch_up)
            if limit == 0:
                continue  # the cap is spent: it catches up next step, decodes go on
            drafts, request.spec_token_ids = request.spec_token_ids, []
            num_new = min(uncomputed + len(drafts), limit)
            drafts = drafts[: max(0, num_new - uncomputed)]
            if drafts and not self.kv.allocate_slots(request, num_new):
                # No room for the drafts: run without them rather than preempt anyone.
                drafts, num_new = [], min(uncomputed, budget)
            while not drafts and not self.kv.allocate_slots(request, num_new):
                victim = self._waiting.victim(self.running)
                budget += self._evict(victim, scheduled, out)
                if victim is request:
                    break
            else:
                self._schedule(scheduled, ScheduledRequest(request, num_new, drafts))
                budget -= num_new
                if uncomputed > 1:
                    catch_up -= num_new

        # Blocks ran out for the running requests: admit nobody (they would be preempted
        # next). Otherwise a head that cannot start may displace over-served tenants'
        # running requests (fair_queue.py); whoever it displaced waits out this step.
        short = bool(out.preempted)
        displaced: set[str] = set()
        while not short and self._waiting and budget > 0:
            request = self._waiting.pop()
            if catch_up == 0 and not request.remote_prefill:
                self._waiting.push(request)  # the step's prompt tokens are spent: next step
                break
            taken = None
            if request.request_id not in displaced and not self._lora_blocked(request):
                while (
                    taken := self._try_admit(request, min(budget, catch_up), scheduled, out)
                ) is None:
                    victim = self._waiting.displaced_by(request, self.running)
                    if victim is None:
                        break
                    budget += self._evict(victim, scheduled, out)
                    displaced.add(victim.request_id)
            if taken is None:
                self._waiting.push(request)  # back in its place
                break
            budget -= taken
            catch_up -= taken

        out.scheduled = list(scheduled.values())
        self._stalled = not out.scheduled and not out.waiting_for_kv
        return out

    def _try_admit(
        self,
        request: Request,
        budget: int,
        scheduled: dict[str, ScheduledRequest],
        out: SchedulerOutput,
    ) -> int | None:
        """Admit a request taken from the queue if a slot and its blocks are free: the
        tokens of budget it takes (0 for a remote-prefill request, which computes nothing
        yet), or None: it waits."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        if self.prepare is not None and request.num_computed_tokens == 0:
            self.prepare(request)
        hits, num_hit_tokens = (
            self.kv.get_computed_blocks(request) if request.num_computed_tokens == 0 else ([], 0)
        )
        uncached = len(request.token_ids) - request.num_computed_tokens - num_hit_tokens
        if request.remote_prefill:
            # Blocks for the whole prompt, cached only once its KV is written; no compute.
            if not self.kv.allocate_slots(request, uncached, hits, cache=False):
                return None
            self._admit(request, num_hit_tokens, RequestStatus.WAITING_FOR_REMOTE_KV)
            out.waiting_for_kv.append(request)
            return 0
        num_new = min(uncached, budget)
        if not self.kv.allocate_slots(request, num_new, hits):
            return None
        self._admit(request, num_hit_tokens, RequestStatus.RUNNING)
        self._schedule(scheduled, ScheduledRequest(request, num_new))
        return num_new

    def _schedule(self, scheduled: dict[str, ScheduledRequest], item: ScheduledRequest) -> None:
        # Charged when scheduled (refunded if undone or rejected), so the next admission in
        # this same step already sees it: two free slots go to two tenants, not one.
        scheduled[item.request.request_id] = item
        self._waiting.charge(item.request, item.num_new_tokens)

    def _lora_blocked(self, request: Request) -> bool:
        """Its adapter waits for one of the running ones to drain."""
        loras = {r.lora for r in self.running if r.lora}
        return (
            bool(request.lora) and request.lora not in loras and len(loras) >= self.config.max_loras
        )

    def _admit(self, request: Request, num_hit_tokens: int, status: RequestStatus) -> None:
        request.staged_kv = None  # what a tier fetch gave it is in its blocks now
        request.num_computed_tokens += num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        request.status = status
        self.running.append(request)

    def _evict(
        self, request: Request, scheduled: dict[str, ScheduledRequest], out: SchedulerOutput
    ) -> int:
        """Preempt in the middle of schedule(): the budget it had this step comes back."""
        undone = scheduled.pop(request.request_id, None)
        if undone is not None:
            self._waiting.charge(request, -undone.num_new_tokens)
        out.preempted.append(request.request_id)
        self._preempt(request)
        return undone.num_new_tokens if undone is not None else 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._waiting.push(request)

    def update_from_output(
        self, out: SchedulerOutput, sampled: Mapping[str, Sequence[SampledToken]]
    ) -> tuple[list[tuple[Request, list[SampledToken]]], list[Request]]:
        """Advance computed counts, append sampled tokens, finish requests.

        `sampled`: per request that sampled, its accepted tokens (one without drafts).
        Returns (requests that got tokens, with the tokens appended: fewer than sampled
        when a stop came first; requests that finished this step).
        """
        advanced: list[tuple[Request, list[SampledToken]]] = []
        finished: list[Request] = []
        for item in out.scheduled:
            request = item.request
            tokens = sampled.get(request.request_id)
            # Accepted drafts have their KV; rejected ones' is never read (the next step
            # writes over it before attending) and their own blocks are released below.
            rejected = len(item.spec_token_ids) - max(0, len(tokens or ()) - 1)
            request.num_computed_tokens += item.num_new_tokens - rejected
            self._waiting.charge(request, -rejected)
            if not tokens:
                continue  # a prompt chunk that does not reach the end yet
            appended: list[SampledToken] = []
            advanced.append((request, appended))
            for token in tokens:
                appended.append(token)
                if self._append(request, token):
                    finished.append(request)
                    break
            else:
                if item.spec_token_ids:
                    self.kv.truncate(request, len(request.token_ids))
        return advanced, finished

    def _append(self, request: Request, token: SampledToken) -> bool:
        """Append a sampled token; finish and release the request if it stops. True if so."""
        request.append_token(token.token_id)
        status = self._check_stop(request, token.token_id)
        if status is None:
            return False
        request.status = status
        self.running.remove(request)
        self._waiting.leave(request)
        del self.requests[request.request_id]
        self.kv.free(request)
        return True

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        # Same order as vLLM: a token that reaches the length limit reports "length" even if
        # it is also a stop token.
        params = request.params
        guide = request.guide
        if guide is not None and not guide.accept(token_id):
            # Only a token sampled without this grammar gets here (a peer that ignored it).
            log.error(
                "request %s: token %d breaks its grammar (%s); aborting it",
                request.request_id,
                token_id,
                guide.error,
            )
            return RequestStatus.FINISHED_ABORTED
        n_out = request.num_output_tokens
        if n_out >= params.max_tokens or len(request.token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if guide is not None and guide.done:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
        if n_out < params.min_tokens:
            return None
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        return None

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        running = set(map(id, self.running))
        waiting = set(map(id, self._waiting))
        held = set(map(id, self._held.values()))
        assert not running & waiting, "a request is both running and waiting"
        assert not held & (running | waiting), "a held request is also queued or running"
        assert len(running) + len(waiting) + len(held) == len(self.requests)
        assert self.kv.num_requests <= len(self.requests)
        assert len(self.running) <= self.config.max_num_seqs
        for r in self.running:
            assert r.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KV)
            assert 0 <= r.num_computed_tokens <= len(r.token_ids)
        for r in [*self._waiting, *self._held.values()]:
            assert r.status == RequestStatus.WAITING
