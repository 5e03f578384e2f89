"""The scalar routing policies, as they were before services/master/policy.py priced
candidates as columns: a Python loop over every candidate, through ClusterView's queries
and services/master/cost.py's scalar `predict` and `decode_cost`.

Kept as the reference the vectorized policies must agree with exactly, plan for plan
(tests/test_policy_fast.py), and as the baseline bench/route_micro.py times beside them.
Not used by the master.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

from rtp_serve.services.common import rendezvous
from rtp_serve.services.common.pb import master_pb2, nameservice_pb2
from rtp_serve.services.master import cost
from rtp_serve.services.master.cluster import ClusterView, Member
from rtp_serve.services.master.packed_hashes import route_hashes
from rtp_serve.services.master.policy import (
    DEFAULT_BLOCK_SIZE,
    Choice,
    Decision,
    NoWorkersError,
    RouteReason,
    predicted,
)


def _rendezvous(key: str, members: list[Member]) -> Member:
    """The member with the highest rendezvous weight for `key` (the first of equals)."""
    k = rendezvous.hash64(key)
    return max(members, key=lambda m: rendezvous.weight(k, rendezvous.hash64(m.id)))


def candidates(view: ClusterView, exclude: Iterable[str] = ()) -> tuple[list[Member], list[Member]]:
    """(first, decode): PD mode -> (prefill workers, decode workers); fused -> (fused, [])."""
    skip = set(exclude)
    by_role = {
        role: [m for m in view.members(role) if m.id not in skip]
        for role in (nameservice_pb2.ROLE_PREFILL, nameservice_pb2.ROLE_DECODE)
    }
    prefill, decode = by_role[nameservice_pb2.ROLE_PREFILL], by_role[nameservice_pb2.ROLE_DECODE]
    if prefill and decode:
        return prefill, decode
    fused = [m for m in view.members(nameservice_pb2.ROLE_FUSED) if m.id not in skip]
    if fused:
        return fused, []
    raise NoWorkersError(
        f"no workers available: {len(prefill)} prefill, {len(decode)} decode, 0 fused"
        + (f" (excluded: {', '.join(sorted(skip))})" if skip else "")
    )


def serving(view: ClusterView, members: list[Member], lora: str) -> list[Member]:
    """The members whose load report lists `lora` among the adapters they serve; all of
    them when none does (reports not in yet: the worker itself answers NOT_FOUND)."""
    if not lora or not members:
        return members
    have = [m for m in members if (r := view.load(m.id)) is not None and lora in r.loras]
    return have or members


def resident(view: ClusterView, member: Member, lora: str) -> bool:
    load = view.load(member.id)
    return not lora or (load is not None and lora in load.resident_loras)


def _running(view: ClusterView, worker_id: str) -> int:
    load = view.load(worker_id)
    return (load.num_running if load is not None else 0) + view.pending(worker_id).requests


def _block_size(view: ClusterView, worker_id: str) -> int:
    load = view.load(worker_id)
    return (load.block_size if load is not None else 0) or DEFAULT_BLOCK_SIZE


def uncached_tokens(view: ClusterView, worker_id: str, num_prompt_tokens: int, matched: int) -> int:
    return max(0, num_prompt_tokens - matched * _block_size(view, worker_id))


class Policy(ABC):
    name: str
    uses_cache = False  # as policy.Policy's

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
        """The plan and why; raises NoWorkersError when no candidate is left."""
        decision = self._decide(view, request)
        if self.uses_cache:
            decision.plan.remote_blocks = reachable(view, route_hashes(request))
        return decision

    def _decide(self, view: ClusterView, request: master_pb2.RouteRequest) -> Decision:
        view.catch_up(request.unix_ms)
        first, decode = candidates(view, request.exclude)
        first, decode = (
            serving(view, first, request.lora_name),
            serving(view, decode, request.lora_name),
        )
        tokens = request.num_prompt_tokens
        if decode and self.max_local_prefill_tokens:
            tail = self._choose_decode(view, request, decode)
            local = self._local_prefill(view, request, tail.member)
            if local is not None:
                return local
            # Not short enough: the prefill side is chosen below, and the decode worker again
            # (it is still the best by its own criterion; the rotation turn is spent).
        head = self._choose_first(view, request, first)
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
        if decode:
            tail = self._choose_decode(view, request, decode)
            blocks = math.ceil(tokens / _block_size(view, tail.member.id))
            view.charge(tail.member.id, blocks=blocks, unix_ms=request.unix_ms)
            plan.prefill.CopyFrom(head.member)
            plan.decode.CopyFrom(tail.member)
            plan.reason += f"; decode {tail.member.id}{tail.reason}"
        else:
            plan.decode.CopyFrom(head.member)
        return Decision(plan, head.why)

    def _local_prefill(
        self, view: ClusterView, request: master_pb2.RouteRequest, decode: Member
    ) -> Decision | None:
        """A decode-only plan when the prompt's uncached part on `decode` is short."""
        matched = view.index.match_all(route_hashes(request), [decode.id])[decode.id]
        tokens = request.num_prompt_tokens
        todo = uncached_tokens(view, decode.id, tokens, matched)
        if todo >= self.max_local_prefill_tokens:
            return None
        local = self._stay_local(view, request, decode, matched)
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
        self, view: ClusterView, request: master_pb2.RouteRequest, decode: Member, matched: int
    ) -> tuple[cost.Prediction | None, str] | None:
        """A prompt short enough for its decode worker (`matched` of its blocks cached
        there): whether that worker computes it
        (its predicted time to first token there, None: none; and a note for the plan's
        reason), or None to send it to a prefill worker after all."""
        return None, ""

    @abstractmethod
    def _choose_first(
        self, view: ClusterView, request: master_pb2.RouteRequest, first: list[Member]
    ) -> Choice:
        """Choose the prefill (or fused) worker."""

    @abstractmethod
    def _choose_decode(
        self, view: ClusterView, request: master_pb2.RouteRequest, decode: list[Member]
    ) -> Choice:
        """Choose the PD decode worker (its reason is a suffix)."""


def _host(member: Member) -> str:
    """The host part of a member's address (host:port, [v6]:port)."""
    return member.address.rpartition(":")[0]


def _rotate(members: Sequence[Member], turn: Iterator[int]) -> Member:
    return members[next(turn) % len(members)]


class RoundRobin(Policy):
    """Cycle through the candidates (sorted by id), ignoring cache and load."""

    name = "round_robin"

    def _choose_first(
        self, view: ClusterView, request: master_pb2.RouteRequest, first: list[Member]
    ) -> Choice:
        chosen = _rotate(first, self._first_turn)
        matched = view.index.match(chosen.id, route_hashes(request))
        reason = f"next in turn {chosen.id}, prefix {matched} blocks"
        return Choice(chosen, matched, reason, RouteReason.ROUND_ROBIN)

    def _choose_decode(
        self, view: ClusterView, request: master_pb2.RouteRequest, decode: list[Member]
    ) -> Choice:
        return Choice(_rotate(decode, self._decode_turn))


def with_room(view: ClusterView, members: list[Member]) -> list[Member]:
    """The members whose waiting queue is below its bound (as last reported); all of them
    when none has room (the chosen one then refuses the request: 429, retry later)."""

    def full(m: Member) -> bool:
        load = view.load(m.id)
        return load is not None and 0 < load.max_num_waiting <= load.num_waiting

    room = [m for m in members if not full(m)]
    return room or members


def reachable(view: ClusterView, hashes: Sequence[bytes]) -> int:
    """What the remote tier can give of the prompt: what its instances hold (T2 and T3),
    and what any worker holds (each wrote it back)."""
    caches = [m.id for m in view.members(nameservice_pb2.ROLE_CACHE)]
    everyone = [w for w in view.index.workers() if w not in caches]
    device = view.index.match_all(hashes, everyone)
    host = view.index.host
    return max(
        max((n + host.match(w, hashes, n) for w, n in device.items()), default=0),
        view.index.match_any(hashes, caches),
    )


def reporting(view: ClusterView, members: list[Member]) -> list[Member]:
    """The members with a fresh load report; all of them when none has one (no NATS, or
    all just started: then costs count only what was routed here)."""
    known = [m for m in members if view.load(m.id) is not None]
    return known or members


class CacheAware(Policy):
    """Lowest predicted time to first token (services/master/cost.py): queue wait, plus the
    prefill of what no reachable tier holds, plus the fetch of what the remote tier does."""

    name = "cache_aware"
    uses_cache = True  # LeastLoad is this policy with every prefix ignored

    def predictions(
        self, view: ClusterView, request: master_pb2.RouteRequest, first: list[Member]
    ) -> tuple[dict[str, int], dict[str, cost.Prediction]]:
        """Each candidate's prefix match in its own pool, and its predicted time to first
        token."""
        ids = [m.id for m in first]
        hashes = route_hashes(request)
        caches = [m.id for m in view.members(nameservice_pb2.ROLE_CACHE)]
        everyone = [w for w in view.index.workers() if w not in caches]
        device = view.index.match_all(hashes, sorted(set(everyone) | set(ids)))
        matched = {w: device[w] for w in ids}
        if self.uses_cache:
            host = view.index.host
            below = {w: host.match(w, hashes, n) for w, n in device.items()}
            remote = reachable(view, hashes)
            local = matched
        else:  # what it would cost with nothing cached anywhere
            below, remote, local = dict.fromkeys(ids, 0), 0, dict.fromkeys(ids, 0)
        reports = {m.id: view.load(m.id) for m in first}
        borrowed = cost.mean_cost([cost.step_cost(r) for r in reports.values()])
        preds = {}
        for m in first:
            own = cost.step_cost(reports[m.id])
            step = own if own.fitted else borrowed
            pred = cost.predict(
                reports[m.id],
                step,
                view.pending(m.id).tokens,
                request.num_prompt_tokens,
                _block_size(view, m.id),
                local[m.id],
                below[m.id],
                remote,
            )
            swap = cost.lora_swap(reports[m.id], step, request.lora_name)
            preds[m.id] = dataclasses.replace(pred, seconds=pred.seconds + swap) if swap else pred
        return matched, preds

    def _choose_first(
        self, view: ClusterView, request: master_pb2.RouteRequest, first: list[Member]
    ) -> Choice:
        first = reporting(view, with_room(view, first))
        matched, preds = self.predictions(view, request, first)
        best = min(p.seconds for p in preds.values())
        tied = [m for m in first if preds[m.id].seconds == best]
        blind = view.event_cutoff_s > 0
        if blind:
            slack = preds[tied[0].id].prefill
            tied = [m for m in first if preds[m.id].seconds <= best + slack]
        if len(tied) == 1:
            chosen, tie = tied[0], ""
        elif request.session_id:
            chosen, tie = _rendezvous(request.session_id, tied), "session"
        elif blind:
            chosen, tie = _rendezvous(request.request_id, tied), "request id"
        else:
            # Every master replica breaks the tie the same way: no rotation state.
            fewest = min(_running(view, m.id) for m in tied)
            idle = [m for m in tied if _running(view, m.id) == fewest]
            chosen = _rendezvous(request.request_id, idle)
            tie = "fewest running" if len(idle) < len(tied) else "request id"
        n, pred = matched[chosen.id], preds[chosen.id]
        reason = f"prefix {n} blocks on {chosen.id}, cost {pred.describe()}"
        if tie:
            reason += f" (tie of {len(tied)} broken by {tie})"
        hit = self.uses_cache and (n or pred.fetched_blocks)
        why = RouteReason.PREFIX_HIT if hit else RouteReason.LEAST_LOADED
        return Choice(chosen, n, reason, RouteReason.AFFINITY if tie == "session" else why, pred)

    def _stay_local(
        self, view: ClusterView, request: master_pb2.RouteRequest, decode: Member, matched: int
    ) -> tuple[cost.Prediction | None, str] | None:
        """Short prompts stay on the decode worker unless a prefill worker would give the
        first token sooner, its KV transfer included: a decode worker busy with its batch
        and its own local prefills hands them to idle prefill workers rather than queue
        them. Only prefill workers on other hosts count: workers on one host share its
        cores, so moving a prompt there adds no compute, only the transfer (measured on a
        2-core box, pd:2:1: handing prompts to the local prefill workers doubled TTFT).
        Where the decode worker's step model is not fitted yet, the size rule alone
        decides."""
        report = view.load(decode.id)
        step = cost.step_cost(report)
        if report is None or not step.fitted:
            return None, ""
        first, _ = candidates(view, request.exclude)
        first = [
            m
            for m in serving(view, first, request.lora_name)
            if view.load(m.id) and _host(m) != _host(decode)
        ]
        _, preds = self.predictions(view, request, [decode, *with_room(view, first)])
        here = preds.pop(decode.id)
        if not preds:
            return here, ""
        transfer = cost.decode_cost(
            report, step, _running(view, decode.id) + 1, request.num_prompt_tokens,
            _block_size(view, decode.id), matched if self.uses_cache else 0,
        ).transfer  # fmt: skip
        # A prefill worker that has computed nothing yet predicts with the mean fitted model
        # (the decode worker's among them): otherwise it never would get the work to fit one.
        away_id = min(preds, key=lambda w: (preds[w].seconds, w))
        away = preds[away_id].seconds + transfer
        if away < here.seconds:
            return None
        return here, (
            f", predicted {here.seconds * 1e3:.1f} ms here against {away * 1e3:.1f} ms "
            f"on {away_id} with the transfer"
        )

    def _choose_decode(
        self, view: ClusterView, request: master_pb2.RouteRequest, decode: list[Member]
    ) -> Choice:
        decode = with_room(view, decode)
        tokens = request.num_prompt_tokens
        reports = {m.id: view.load(m.id) for m in decode}
        borrowed = cost.mean_cost([cost.step_cost(r) for r in reports.values()])
        local = (
            view.index.match_all(route_hashes(request), [m.id for m in decode])
            if self.uses_cache
            else dict.fromkeys(reports, 0)
        )
        costs, over = {}, {}
        for m in decode:
            own = cost.step_cost(reports[m.id])
            rows, over[m.id] = cost.decode_rows(reports[m.id], view.pending(m.id).requests)
            bs = _block_size(view, m.id)
            costs[m.id] = cost.decode_cost(
                reports[m.id], own if own.fitted else borrowed, rows, tokens, bs, local[m.id]
            )

        # Workers that have not reported yet rank after those that have; then those with
        # room for the prompt's blocks (as far as they lack them) before those without;
        # then those with a free slot in their batch, and among full ones the fewest
        # requests waiting for a slot; one with the request's LoRA adapter resident before
        # one that would load it; then the lowest cost (transfer + a decode step of its
        # batch), the most free blocks.
        def free(m: Member) -> int:
            load, pending = reports[m.id], view.pending(m.id).blocks
            return load.free_blocks - pending if load is not None else -pending

        def key(m: Member) -> tuple[bool, bool, int, bool, float, int]:
            short = free(m) < costs[m.id].transferred_blocks
            cold = not resident(view, m, request.lora_name)
            most_free = 0 if view.event_cutoff_s > 0 else -free(m)
            return (reports[m.id] is None, short, over[m.id], cold, costs[m.id].seconds,
                    most_free)  # fmt: skip

        best = min(key(m) for m in decode)
        tied = [m for m in decode if key(m) == best]
        chosen = _rendezvous(request.request_id, tied)  # the same on every replica
        if best[0]:
            return Choice(chosen, reason=" (no load report)")
        c, slots = costs[chosen.id], cost.describe_slots(over[chosen.id])
        return Choice(chosen, reason=f" (free {free(chosen)} blocks, {slots}, cost {c.describe()})")


class LeastLoad(CacheAware):
    """Lowest predicted time to first token as if nothing were cached anywhere: the
    least-loaded worker (the baseline that shows what the cache part of cache_aware buys)."""

    name = "least_load"
    uses_cache = False


REFERENCES: dict[str, type[Policy]] = {p.name: p for p in (CacheAware, LeastLoad, RoundRobin)}


def make_reference(name: str, max_local_prefill_tokens: int = 0) -> Policy:
    return REFERENCES[name](max_local_prefill_tokens)
