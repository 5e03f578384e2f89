"""Where a request runs: ask a master; if none is in reach, pick a worker ourselves.

The master's plan is cache- and load-aware. Masters are active-active replicas that follow
the same event stream, so any of them can route any request: each request asks the live
master its id hashes to first (rendezvous hashing: requests spread evenly, a request and
its migrations stay on one master, and a failed master's share alone moves), and the next
one when that master cannot answer. The routes to one master that arrive while a call to
it is in flight go together as one call (services/frontend/route_batcher.py). Without any
master the frontend still serves: it keeps the membership the nameservice's watch reports
and round-robins over fused workers, or over prefill + decode pairs (docs/design.md,
"Reliability rules": the master being down degrades the service, it does not fail
requests that can still be served).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from rtp_serve.services.common import grpc_util, rendezvous
from rtp_serve.services.common.kv_namespace import KVNamespace
from rtp_serve.services.common.naming import WORKER_ROLES, MemberSet
from rtp_serve.services.common.pb import master_pb2, master_pb2_grpc
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from rtp_serve.services.frontend.errors import ErrorKind, FrontendError, from_rpc_error
from rtp_serve.services.frontend.route_batcher import RouteBatcher
from rtp_serve.services.frontend.worker_streams import WorkerStreams

log = logging.getLogger(__name__)

ROUTE_TIMEOUT_S = 2.0
# After a master timed out or became unreachable, ask it nothing for this long.
MASTER_BACKOFF_S = 1.0
_FALLBACK_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

Watch = Callable[[], AsyncIterator[ns_pb2.MembershipEvent]]


def master_list(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """Master addresses from "host:port[,host:port...]" (or a sequence of them)."""
    items = (value or "").split(",") if isinstance(value, str | None) else value
    return tuple(a.strip() for a in items if a.strip())


@dataclass(frozen=True, slots=True)
class Route:
    decode: ns_pb2.Member  # the worker whose Generate stream we open (decode or fused)
    prefill: ns_pb2.Member | None  # PD mode: the worker that computes the prompt
    source: str  # "master" or "fallback"
    plan: master_pb2.RoutePlan | None = None  # the master's, with its prediction

    @property
    def predicted_ttft_s(self) -> float:
        """The master's prediction, from routing to the first token (0: none)."""
        return self.plan.predicted_ttft_s if self.plan is not None else 0.0

    @property
    def prefill_address(self) -> str:
        return self.prefill.address if self.prefill is not None else ""

    @property
    def remote_blocks(self) -> int | None:
        """The master's RoutePlan.remote_blocks (None: it did not say)."""
        plan = self.plan
        return plan.remote_blocks if plan is not None and plan.HasField("remote_blocks") else None


class Membership(MemberSet):
    """The cluster as the nameservice reports it: enough to route without the master."""

    def __init__(self) -> None:
        super().__init__()
        self._turn = itertools.count()
        self._kv: KVNamespace | None = None

    def num_workers(self) -> int:
        """Workers of any role known now."""
        return sum(m.role in WORKER_ROLES for m in self.members.values())

    def apply(self, event: ns_pb2.MembershipEvent) -> None:
        super().apply(event)
        # The KV namespace the workers registered (the first's by id: the nameservice
        # admits no other for the same model); None while no worker is known.
        workers = sorted(
            (m for m in self.members.values() if m.role in WORKER_ROLES), key=lambda m: m.id
        )
        kv = next((kv for m in workers if (kv := KVNamespace.of(m)) is not None), None)
        if kv is not None and kv != self._kv:
            log.info("the workers' KV namespace: block size %d, cache salt %s (%s)",
                     kv.block_size, kv.cache_salt.hex(), kv.kv_numerics)  # fmt: skip
        self._kv = kv

    def kv_namespace(self) -> KVNamespace | None:
        """Block size and cache salt of the workers' model, learnt from their registration."""
        return self._kv

    def has_route(self) -> bool:
        roles = {m.role for m in self.members.values()}
        return ns_pb2.ROLE_FUSED in roles or {ns_pb2.ROLE_PREFILL, ns_pb2.ROLE_DECODE} <= roles

    def pick(self, exclude: frozenset[str] = frozenset()) -> Route | None:
        """Round robin over fused workers, else over (prefill, decode) pairs."""
        fused = self.with_role(ns_pb2.ROLE_FUSED, exclude)
        if fused:
            return Route(fused[next(self._turn) % len(fused)], None, "fallback")
        prefill = self.with_role(ns_pb2.ROLE_PREFILL, exclude)
        decode = self.with_role(ns_pb2.ROLE_DECODE, exclude)
        if prefill and decode:
            turn = next(self._turn)
            return Route(decode[turn % len(decode)], prefill[turn % len(prefill)], "fallback")
        return None


class Router:
    """Routes requests; also owns the gRPC channels to the master and the workers."""

    def __init__(
        self,
        master: str | Sequence[str] | None = None,
        watch: Watch | None = None,
        route_timeout: float = ROUTE_TIMEOUT_S,
        frontend_id: str | None = None,
    ) -> None:
        # Fixed addresses ("a,b" or a list); none: the masters the nameservice reports.
        self.masters = master_list(master)
        # This frontend's member id: the master leases the ids of the requests it routes
        # for us to it (services/master/leases.py).
        self.frontend_id = frontend_id or f"frontend-{uuid.uuid4().hex[:8]}"
        self.membership = Membership()
        self._watch = watch
        self._route_timeout = route_timeout
        self._channels = grpc_util.ChannelCache()
        self.streams = WorkerStreams(self.channel)  # the requests sent to each worker
        self._master_down_until: dict[str, float] = {}  # address -> monotonic time
        self._leased: dict[str, set[str]] = {}  # request id -> masters holding its lease
        self._batchers: dict[str, RouteBatcher] = {}  # master address -> its routes
        self._turn = itertools.count()  # requests without an id rotate over the masters
        self._watch_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._watch is not None:
            self._watch_task = asyncio.create_task(self._follow(self._watch), name="membership")
        elif not self.masters:
            log.warning("no master and no nameservice: no request can be routed")

    async def close(self) -> None:
        await self.flush(self._route_timeout)  # the last releases: briefly, best effort
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        await self.streams.close()
        await self._channels.close()

    async def flush(self, timeout: float) -> None:
        """Wait up to `timeout` seconds (each master) for the routes and releases waiting or
        in flight."""
        for batcher in list(self._batchers.values()):
            await batcher.flush(timeout)

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    def _batcher(self, address: str) -> RouteBatcher:
        """The routes to the master at `address`, coalesced while a call is in flight."""
        batcher = self._batchers.get(address)
        if batcher is None:
            batcher = self._batchers[address] = RouteBatcher(
                lambda: master_pb2_grpc.MasterStub(self.channel(address)),
                release_timeout_s=self._route_timeout,
            )
        return batcher

    def master_addresses(self) -> list[str]:
        """Every master known: the fixed ones, else the nameservice's (a master that left
        its membership is asked nothing more)."""
        if self.masters:
            return list(self.masters)
        return [m.address for m in self.membership.with_role(ns_pb2.ROLE_MASTER)]

    def masters_for(self, request_id: str) -> list[str]:
        """The masters to ask for `request_id`, in order, less those backing off."""
        now = time.monotonic()
        live = [a for a in self.master_addresses() if self._master_down_until.get(a, 0.0) <= now]
        if len(live) <= 1:
            return live
        if not request_id:
            turn = next(self._turn) % len(live)
            return live[turn:] + live[:turn]
        return rendezvous.order(request_id, live)

    def num_workers(self) -> int:
        """Workers known from the nameservice (0 without a membership view)."""
        return self.membership.num_workers()

    async def ready(self) -> bool:
        """True when some request could be routed to a worker now."""
        if self.membership.has_route():
            return True
        if self._watch is None and self.masters:  # no membership view: trust the masters
            checks = [grpc_util.check_health(a, timeout=0.5) for a in self.masters]
            return any(await asyncio.gather(*checks))
        return False

    async def route(self, request: master_pb2.RouteRequest, timeout: float | None = None) -> Route:
        """A route for `request`; raises FrontendError (UNAVAILABLE: no worker can take it;
        CONFLICT: its id is in flight through another frontend). `timeout`: what is left of
        the request's deadline (the master gets no longer). A route from the master leases
        the request id to this frontend until `release`. The request is stamped now
        (`unix_ms`) unless it is already: every master asked routes it as of that moment."""
        request.frontend_id = self.frontend_id
        request.unix_ms = request.unix_ms or time.time_ns() // 1_000_000
        deadline = time.monotonic() + timeout if timeout is not None else None
        for address in self.masters_for(request.request_id):
            left = deadline - time.monotonic() if deadline is not None else None
            route, ask_another = await self._ask_master(address, request, left)
            if route is not None:
                return route
            if not ask_another:
                break
        route = self.membership.pick(frozenset(request.exclude))
        if route is None:
            raise FrontendError(
                ErrorKind.UNAVAILABLE, "no worker is available", code="service_unavailable"
            )
        log.debug(
            "route %s -> %s (fallback)",
            request.request_id,
            route.decode.id,
            extra={"request_id": request.request_id},
        )
        return route

    def release(self, request_id: str) -> None:
        """The request ended: end its lease at every master that routed it (a migration may
        have been routed by another), in the background, with that master's next call (a lost
        release only keeps a client's retry through another frontend waiting until it
        expires)."""
        msg = master_pb2.ReleaseRequest(request_id=request_id, frontend_id=self.frontend_id)
        for address in self._leased.pop(request_id, ()):
            self._batcher(address).release(msg)

    async def _ask_master(
        self, address: str, request: master_pb2.RouteRequest, timeout: float | None
    ) -> tuple[Route | None, bool]:
        """The master's plan, or None and whether another master may still be asked (not
        once the request's own deadline ran out)."""
        channel = self.channel(address)
        own = timeout is not None and timeout < self._route_timeout  # the request's deadline
        rid = request.request_id
        try:
            plan = await self._batcher(address).route(
                request, max(0.0, timeout) if own else self._route_timeout
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code not in _FALLBACK_CODES:
                raise from_rpc_error(exc, "master") from exc
            timed_out = code == grpc.StatusCode.DEADLINE_EXCEEDED
            if timed_out and rid:  # it may have leased the id before it ran out of time
                self._leased.setdefault(rid, set()).add(address)
            # A master that timed out, or whose connection is down, is asked nothing for a
            # while; one that answered UNAVAILABLE itself (no worker it can use) is not.
            down = timed_out or channel.get_state() != grpc.ChannelConnectivity.READY
            if down and not (timed_out and own):
                self._master_down_until[address] = time.monotonic() + MASTER_BACKOFF_S
            log.info(
                "master %s: %s; asking another master or routing locally",
                address,
                exc.details() or code.name,
                extra={"request_id": rid},
            )
            return None, not (timed_out and own)
        if rid:
            self._leased.setdefault(rid, set()).add(address)
        if not plan.decode.address:
            log.warning("master %s returned a plan without a worker: %s", address, plan)
            return None, True
        prefill = plan.prefill if plan.HasField("prefill") and plan.prefill.address else None
        return Route(plan.decode, prefill, "master", plan), False

    async def _follow(self, watch: Watch) -> None:
        while True:  # the watch reconnects by itself; this guards against anything else
            try:
                async for event in watch():
                    self.membership.apply(event)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("membership watch failed; restarting it")
            await asyncio.sleep(1.0)
