"""Routing policies: given the cluster view and a request, pick the workers.

A cluster runs PD-disaggregated (prefill + decode workers) or fused (one worker does both).
If both kinds are present, PD wins while at least one prefill and one decode worker are
available (after `exclude`); otherwise fused workers are used. A fused worker is returned
as the plan's `decode`, with `prefill` unset.

`cache_aware` (the default) picks the candidate with the lowest predicted time to first
token (services/master/cost.py): the wait for what is queued there (as reported, plus what
was routed there since), the prefill of the prompt tokens it would compute, and the fetch
of the blocks it would copy from the remote tier, each at that worker's own fitted rates
(its LoadReport). A long cached prefix lowers the prefill, so it wins unless that worker's
queue takes longer than the prefill it saves; a worker that can fetch the prefix from the
remote tier competes at the fetch's cost, so a hot prefix spreads once its holder's queue
makes it the slower answer (no hotspot spiral). `least_load` is the same prediction with
every cache ignored; `round_robin` cycles.
A worker whose waiting queue is at its max_num_waiting is skipped while another candidate
has room (it would refuse the request). A worker without a load report within the view's
load TTL (none yet, or its reports went stale: maybe down, or cut off from NATS) is skipped
while another has a fresh one: unknown load is not an idle worker.
Ties: session affinity (a stable hash of session_id over the tied workers), else fewest
running, else a stable hash of the request id: every master replica, given the same view,
makes the same choice (no per-process rotation or affinity state). Under an event cutoff
(master replicas, services/master/held_events.py) the routes of the last cutoff are not
counted yet, by this master or any: a burst would all go to the cheapest candidate. There,
every candidate within one such request of the cheapest (the prefill this request would
compute there) counts as tied, and the request id picks among them (no fewest running, and
on the decode side no most free blocks: both would pile the burst up again).

The decode side (PD) goes, among the workers with room for the prompt blocks they lack, to
the one with the lowest cost until the second token: the KV transfer of the blocks it lacks
(the prefill worker sends only what follows its cached prefix) at its fitted receive rate,
plus one decode step of its batch with this request in it (cost.decode_cost); then the most
free KV blocks (less those routed to it since its report), then the request-id hash,
skipping full queues the same way. With `max_local_prefill_tokens`, a prompt whose uncached part is
shorter stays on the chosen decode worker (no prefill worker, no KV transfer); under the
predicting policies only while that worker's predicted time to first token is no worse than
the best prefill worker's on another host plus the transfer. Every
choice is charged to the view (`charge`) until the worker's next LoadReport, so a burst of
requests spreads out instead of piling up.

How (the same decisions, at a thousand candidates): the view keeps every member's load and
pending charges as columns (services/master/load_table.py), and a route prices all its
candidates with one numpy expression per term (services/master/cost.py, operation for
operation the scalar formulas, so the same doubles and the same choices); only the few
workers that hold the prompt's first block are looked up in the prefix index. The scalar
implementation stays as the reference the tests hold this one to
(services/master/policy_reference.py).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from rtp_serve.services.common.pb import master_pb2, nameservice_pb2
from rtp_serve.services.master import cost
from rtp_serve.services.master.cluster import ClusterView, Member
from rtp_serve.services.master.load_table import DEFAULT_BLOCK_SIZE, Loads
from rtp_serve.services.master.packed_hashes import route_hashes
from rtp_serve.services.master.pool import Pool, lora_mask, reporting, serving, with_room
from rtp_serve.services.master.prompt_prefix import Prefix


class NoWorkersError(Exception):
    """No worker can take the request (none registered, or all excluded)."""


class RouteReason(enum.StrEnum):
    """Why the first (prefill or fused) worker was chosen, in a few words (a metric label;
    the plan's free-text `reason` has the details)."""

    PREFIX_HIT = "prefix_hit"  # it holds part of the prompt, and that made it cheapest
    LEAST_LOADED = "least_loaded"  # lowest predicted cost without a prefix hit
    AFFINITY = "affinity"  # a tie broken by the session id
    ROUND_ROBIN = "round_robin"  # its turn
    LOCAL_PREFILL = "local_prefill"  # PD mode, but the decode worker computes a short prompt
    NO_WORKERS = "no_workers"  # no route (NoWorkersError)


@dataclass(frozen=True, slots=True)
class Choice:
    member: Member
    matched_blocks: int = 0
    reason: str = ""
    why: RouteReason = RouteReason.LEAST_LOADED
    prediction: cost.Prediction | None = None  # None: this policy predicts nothing


def predicted(pred: cost.Prediction | None) -> dict[str, float]:
    """A RoutePlan's prediction fields (all 0: no prediction in seconds)."""
    if pred is None or pred.in_tokens:
        return {}
    return {
        "predicted_ttft_s": pred.seconds,
        "predicted_wait_s": pred.wait,
        "predicted_prefill_s": pred.prefill,
        "predicted_fetch_s": pred.fetch,
    }


@dataclass(frozen=True, slots=True)
class Decision:
    plan: master_pb2.RoutePlan
    reason: RouteReason


# -- candidates ------------------------------------------------------------------------------
def candidates(view: ClusterView, exclude: Iterable[str] = ()) -> tuple[Pool, Pool]:
    """(first, decode): PD mode -> (prefill workers, decode workers); fused -> (fused, [])."""
    table, skip = view.table, set(exclude)
    gone = np.array([s for w in skip if (s := table.slot(w)) is not None], dtype=np.intp)

    def pool(role: int) -> Pool:
        slots = table.order(role)
        return Pool(view, slots[~np.isin(slots, gone)] if len(gone) else slots)

    prefill, decode = pool(nameservice_pb2.ROLE_PREFILL), pool(nameservice_pb2.ROLE_DECODE)
    if len(prefill) and len(decode):
        return prefill, decode
    fused = pool(nameservice_pb2.ROLE_FUSED)
    if len(fused):
        return fused, Pool(view, fused.slots[:0])
    raise NoWorkersError(
        f"no workers available: {len(prefill)} prefill, {len(decode)} decode, 0 fused"
        + (f" (excluded: {', '.join(sorted(skip))})" if skip else "")
    )


def _running(view: ClusterView, worker_id: str) -> int:
    load = view.load(worker_id)
    return (load.num_running if load is not None else 0) + view.pending(worker_id).requests


def _block_size(view: ClusterView, worker_id: str) -> int:
    load = view.load(worker_id)
    return (load.block_size if load is not None else 0) or DEFAULT_BLOCK_SIZE


def uncached_tokens(view: ClusterView, worker_id: str, num_prompt_tokens: int, matched: int) -> int:
    return max(0, num_prompt_tokens - matched * _block_size(view, worker_id))


@dataclass(slots=True)
class Ask:
    """One Route call: the view, the request, and what is looked up once for it."""

    view: ClusterView
    request: master_pb2.RouteRequest
    _prefix: Prefix | None = field(default=None)
    _hashes: Sequence[bytes] | None = field(default=None)

    @property
    def hashes(self) -> Sequence[bytes]:
        """The prompt's block hashes (packed_hashes.route_hashes)."""
        if self._hashes is None:
            self._hashes = route_hashes(self.request)
        return self._hashes

    @property
    def prefix(self) -> Prefix:
        if self._prefix is None:
            self._prefix = Prefix.of(self.view, self.hashes)
        return self._prefix


class Policy(ABC):
    name: str
    # Whether it routes by where the prompt's blocks are; such a plan also says how many of
    # them the remote tier can give (RoutePlan.remote_blocks).
    uses_cache = False

    def __init__(self, max_local_prefill_tokens: int = 0) -> None:
        # Conditional disaggregation: in PD mode a prompt whose uncached part is shorter than
        # this is computed by its decode worker itself; moving its KV would cost more than
        # the prefill it saves (0: every prompt goes to a prefill worker).
        self.max_local_prefill_tokens = max_local_prefill_tokens
        # Separate turns for each side, so rotations never lock prefill and decode in step.
        self._first_turn = itertools.count()
        self._decode_turn = itertools.count()

    def route(self, view: ClusterView, request: master_pb2.RouteRequest) -> master_pb2.RoutePlan:
        """Raises NoWorkersError when no candidate is left."""
        return self.decide(view, request).plan

    def decide(self, view: ClusterView, request: master_pb2.RouteRequest) -> Decision:
        """The plan and why; raises NoWorkersError when no candidate is left. A policy that
        routes by prefix says how much of the prompt the remote tier can give, so that a
        worker holding as much asks it for nothing."""
        view.catch_up(request.unix_ms)  # the events due under an event cutoff
        view.expire_charges()  # the table's pending sums as `view.pending` would say
        ask = Ask(view, request)
        decision = self._decide(ask)
        if self.uses_cache:
            decision.plan.remote_blocks = ask.prefix.reachable
        return decision

    def _decide(self, ask: Ask) -> Decision:
        view, request = ask.view, ask.request
        first, decode = candidates(view, request.exclude)
        first, decode = serving(first, request.lora_name), serving(decode, request.lora_name)
        tokens = request.num_prompt_tokens
        if len(decode) and self.max_local_prefill_tokens:
            tail = self._choose_decode(ask, decode)
            local = self._local_prefill(ask, tail.member)
            if local is not None:
                return local
            # Not short enough: the prefill side is chosen below, and the decode worker again
            # (it is still the best by its own criterion; the rotation turn is spent).
        head = self._choose_first(ask, first)
        plan = master_pb2.RoutePlan(
            matched_blocks=head.matched_blocks,
            policy=self.name,
            reason=head.reason,
            **predicted(head.prediction),
        )
        todo = head.prediction.computed_tokens if head.prediction is not None else None
        if todo is None:
            todo = uncached_tokens(view, head.member.id, tokens, head.matched_blocks)
        view.charge(head.member.id, todo, unix_ms=request.unix_ms)
        if len(decode):
            tail = self._choose_decode(ask, Pool(view, decode.slots))  # loads after the charge
            blocks = math.ceil(tokens / _block_size(view, tail.member.id))
            view.charge(tail.member.id, blocks=blocks, unix_ms=request.unix_ms)
            plan.prefill.CopyFrom(head.member)
            plan.decode.CopyFrom(tail.member)
            plan.reason += f"; decode {tail.member.id}{tail.reason}"
        else:
            plan.decode.CopyFrom(head.member)
        return Decision(plan, head.why)

    def _local_prefill(self, ask: Ask, decode: Member) -> Decision | None:
        """A decode-only plan when the prompt's uncached part on `decode` is short."""
        view, request = ask.view, ask.request
        matched = ask.prefix.device.get(decode.id, 0)
        tokens = request.num_prompt_tokens
        todo = uncached_tokens(view, decode.id, tokens, matched)
        if todo >= self.max_local_prefill_tokens:
            return None
        local = self._stay_local(ask, decode, matched)
        if local is None:
            return None
        prediction, why = local
        blocks = math.ceil(tokens / _block_size(view, decode.id))
        view.charge(decode.id, todo, blocks=blocks, unix_ms=request.unix_ms)
        plan = master_pb2.RoutePlan(
            decode=decode,
            matched_blocks=matched,
            policy=self.name,
            reason=f"local prefill on {decode.id}: {todo} uncached tokens "
            f"< {self.max_local_prefill_tokens} (prefix {matched} blocks){why}",
            **predicted(prediction),
        )
        return Decision(plan, RouteReason.LOCAL_PREFILL)

    def _stay_local(
        self, ask: Ask, decode: Member, matched: int
    ) -> tuple[cost.Prediction | None, str] | None:
        """A prompt short enough for its decode worker (`matched` of its blocks cached
        there): whether that worker computes it
        (its predicted time to first token there, None: none; and a note for the plan's
        reason), or None to send it to a prefill worker after all."""
        return None, ""

    @abstractmethod
    def _choose_first(self, ask: Ask, first: Pool) -> Choice:
        """Choose the prefill (or fused) worker."""

    @abstractmethod
    def _choose_decode(self, ask: Ask, decode: Pool) -> Choice:
        """Choose the PD decode worker (its reason is a suffix)."""


def _rotate(pool: Pool, turn: Iterator[int]) -> Member:
    return pool.member(next(turn) % len(pool))


class RoundRobin(Policy):
    """Cycle through the candidates (sorted by id), ignoring cache and load."""

    name = "round_robin"

    def _choose_first(self, ask: Ask, first: Pool) -> Choice:
        chosen = _rotate(first, self._first_turn)
        matched = ask.view.index.match(chosen.id, ask.hashes)
        reason = f"next in turn {chosen.id}, prefix {matched} blocks"
        return Choice(chosen, matched, reason, RouteReason.ROUND_ROBIN)

    def _choose_decode(self, ask: Ask, decode: Pool) -> Choice:
        return Choice(_rotate(decode, self._decode_turn))


@dataclass(slots=True)
class Priced:
    """Candidates with their predicted time to first token (`CacheAware.predictions`)."""

    pool: Pool
    loads: Loads
    steps: cost.Steps
    seconds: np.ndarray
    local: np.ndarray | None  # blocks in its pool that count (None: 0 everywhere)
    host: np.ndarray | None  # blocks in its host tier after those
    reachable: int

    def prediction(self, ask: Ask, i: int) -> cost.Prediction:
        """Candidate `i`'s prediction in full, by the scalar formulas (the same seconds)."""
        view, request = ask.view, ask.request
        worker_id = self.pool.member(i).id
        report, step = view.load(worker_id), self.steps.step(i)
        pred = cost.predict(
            report,
            step,
            int(self.loads.pending_tokens[i]),
            request.num_prompt_tokens,
            int(self.loads.block_size[i]),
            int(self.local[i]) if self.local is not None else 0,
            int(self.host[i]) if self.host is not None else 0,
            self.reachable,
        )
        swap = cost.lora_swap(report, step, request.lora_name)
        return dataclasses.replace(pred, seconds=pred.seconds + swap) if swap else pred


class CacheAware(Policy):
    """Lowest predicted time to first token (services/master/cost.py): queue wait, plus the
    prefill of what no reachable tier holds, plus the fetch of what the remote tier does."""

    name = "cache_aware"
    uses_cache = True  # LeastLoad is this policy with every prefix ignored

    def predictions(self, ask: Ask, first: Pool) -> Priced:
        """Each candidate's predicted time to first token."""
        loads = first.loads
        steps = cost.Steps.of(loads)
        if self.uses_cache:
            prefix = ask.prefix
            local, host, reachable = (
                first.column(prefix.device),
                first.column(prefix.host),
                prefix.reachable,
            )
        else:  # what it would cost with nothing cached anywhere
            local = host = None
            reachable = 0
        tokens = ask.request.num_prompt_tokens
        seconds = cost.predict_seconds(loads, steps, tokens, local, host, reachable)
        if lora := ask.request.lora_name:
            cold = ~lora_mask(first, loads, lora, resident=True)
            seconds = seconds + cost.lora_swap_seconds(steps, cold)
        return Priced(first, loads, steps, seconds, local, host, reachable)

    def _choose_first(self, ask: Ask, first: Pool) -> Choice:
        request = ask.request
        first = reporting(with_room(first))
        priced = self.predictions(ask, first)
        seconds = priced.seconds
        tied = np.flatnonzero(seconds == seconds.min())
        blind = ask.view.event_cutoff_s > 0
        if blind:  # within one request's prefill of the best (see the module docstring)
            slack = priced.prediction(ask, int(tied[0])).prefill
            tied = np.flatnonzero(seconds <= seconds.min() + slack)
        if len(tied) == 1:
            i, tie = int(tied[0]), ""
        elif request.session_id:
            i, tie = int(tied[first.pick(request.session_id, tied)]), "session"
        elif blind:
            i, tie = int(tied[first.pick(request.request_id, tied)]), "request id"
        else:
            # Every master replica breaks the tie the same way: no rotation state.
            loads = priced.loads
            running = (loads.running + loads.pending_requests)[tied]
            idle = tied[running == running.min()]
            i = int(idle[first.pick(request.request_id, idle)])
            tie = "fewest running" if len(idle) < len(tied) else "request id"
        chosen, pred = first.member(i), priced.prediction(ask, i)
        n = ask.prefix.device.get(chosen.id, 0)
        reason = f"prefix {n} blocks on {chosen.id}, cost {pred.describe()}"
        if tie:
            reason += f" (tie of {len(tied)} broken by {tie})"
        hit = self.uses_cache and (n or pred.fetched_blocks)
        why = RouteReason.PREFIX_HIT if hit else RouteReason.LEAST_LOADED
        return Choice(chosen, n, reason, RouteReason.AFFINITY if tie == "session" else why, pred)

    def _stay_local(
        self, ask: Ask, decode: Member, matched: int
    ) -> tuple[cost.Prediction | None, str] | None:
        """Short prompts stay on the decode worker unless a prefill worker would give the
        first token sooner, its KV transfer included: a decode worker busy with its batch
        and its own local prefills hands them to idle prefill workers rather than queue
        them. Only prefill workers on other hosts count: workers on one host share its
        cores, so moving a prompt there adds no compute, only the transfer (measured on a
        2-core box, pd:2:1: handing prompts to the local prefill workers doubled TTFT).
        Where the decode worker's step model is not fitted yet, the size rule alone
        decides."""
        view, request = ask.view, ask.request
        report = view.load(decode.id)
        step = cost.step_cost(report)
        if report is None or not step.fitted:
            return None, ""
        first, _ = candidates(view, request.exclude)
        first = serving(first, request.lora_name)
        loads = first.loads
        here = Pool(view, np.array([view.table.slot(decode.id)], dtype=np.intp))
        first = with_room(first.take(loads.fresh & (loads.host != here.loads.host[0])))
        pool = Pool(view, np.concatenate([here.slots, first.slots]))
        priced = self.predictions(ask, pool)
        if len(pool) == 1:
            return priced.prediction(ask, 0), ""
        here = priced.prediction(ask, 0)
        transfer = cost.decode_cost(
            report, step, _running(view, decode.id) + 1, request.num_prompt_tokens,
            _block_size(view, decode.id), matched if self.uses_cache else 0,
        ).transfer  # fmt: skip
        # A prefill worker that has computed nothing yet predicts with the mean fitted model
        # (the decode worker's among them): otherwise it never would get the work to fit one.
        k = 1 + int(np.argmin(priced.seconds[1:]))  # the lowest id among equals
        away_id, away = pool.member(k).id, float(priced.seconds[k]) + transfer
        if away < here.seconds:
            return None
        return here, (
            f", predicted {here.seconds * 1e3:.1f} ms here against {away * 1e3:.1f} ms "
            f"on {away_id} with the transfer"
        )

    def _choose_decode(self, ask: Ask, decode: Pool) -> Choice:
        request = ask.request
        decode = with_room(decode)
        loads = decode.loads
        steps = cost.Steps.of(loads)
        tokens = request.num_prompt_tokens
        local = decode.column(ask.prefix.device) if self.uses_cache else None
        if local is None:
            local = np.zeros(len(decode), dtype=np.int64)
        rows, over = cost.decode_rows_all(loads)
        seconds, blocks = cost.decode_seconds(loads, steps, rows, tokens, local)
        # Workers that have not reported yet rank after those that have; then those with
        # room for the prompt's blocks (as far as they lack them) before those without;
        # then those with a free slot in their batch, and among full ones the fewest
        # requests waiting for a slot; one with the request's LoRA adapter resident before
        # one that would load it; then the lowest cost (transfer + a decode step of its
        # batch), the most free blocks: the first of these keys that differs decides.
        free = loads.free - loads.pending_blocks
        cold = (
            ~lora_mask(decode, loads, request.lora_name, resident=True)
            if request.lora_name
            else np.zeros(len(decode), dtype=bool)
        )
        tied = np.arange(len(decode))
        keys = [~loads.fresh, free < blocks, over, cold, seconds, -free]
        for key in keys[:-1] if ask.view.event_cutoff_s > 0 else keys:
            k = key[tied]
            tied = tied[k == k.min()]
        i = int(tied[decode.pick(request.request_id, tied)])  # the same on every replica
        chosen = decode.member(i)
        if not loads.fresh[i]:
            return Choice(chosen, reason=" (no load report)")
        report = ask.view.load(chosen.id)
        c = cost.decode_cost(
            report, steps.step(i), int(rows[i]), tokens, int(loads.block_size[i]), int(local[i])
        )
        slots = cost.describe_slots(int(over[i]))
        return Choice(chosen, reason=f" (free {int(free[i])} blocks, {slots}, cost {c.describe()})")


class LeastLoad(CacheAware):
    """Lowest predicted time to first token as if nothing were cached anywhere: the
    least-loaded worker (the baseline that shows what the cache part of cache_aware buys)."""

    name = "least_load"
    uses_cache = False


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (CacheAware, LeastLoad, RoundRobin)}


def make_policy(name: str, max_local_prefill_tokens: int = 0) -> Policy:
    try:
        return POLICIES[name](max_local_prefill_tokens)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
