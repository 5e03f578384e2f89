"""rtp.v1.Master over gRPC: validate the request, lease its id to the frontend asking
(services/master/leases.py), ask the policy, map errors to status codes (Route, or many
routes in one call: RouteBatch); release a lease; and the prefix index as it stands
(Index)."""

from __future__ import annotations

import logging
import time

import grpc
from opentelemetry import trace

from rtp_serve.services.common import tracing
from rtp_serve.services.common.pb import master_pb2, master_pb2_grpc
from rtp_serve.services.master import metrics
from rtp_serve.services.master.charge_exchange import ChargeExchange
from rtp_serve.services.master.cluster import ClusterView
from rtp_serve.services.master.leases import RequestLeases
from rtp_serve.services.master.packed_hashes import route_hashes
from rtp_serve.services.master.policy import NoWorkersError, Policy, RouteReason
from rtp_serve.services.master.prefix_index import BLOCK_HASH_BYTES

log = logging.getLogger(__name__)

MAX_BLOCK_HASHES = 1 << 20  # ~16M tokens at 16 per block: anything longer is a broken client
MAX_BATCH = 1024  # routes in one RouteBatch call


def validate(request: master_pb2.RouteRequest) -> None:
    """Raises ValueError naming the first bad field."""
    if request.packed_block_hashes:
        if request.block_hashes:
            raise ValueError("block_hashes and packed_block_hashes are both set")
        n, odd = divmod(len(request.packed_block_hashes), BLOCK_HASH_BYTES)
        if odd:
            raise ValueError(
                f"packed_block_hashes is {len(request.packed_block_hashes)} bytes, not a "
                f"multiple of {BLOCK_HASH_BYTES}"
            )
        if n > MAX_BLOCK_HASHES:
            raise ValueError(f"too many packed_block_hashes ({n})")
        return
    hashes = request.block_hashes
    if len(hashes) > MAX_BLOCK_HASHES:
        raise ValueError(f"too many block_hashes ({len(hashes)})")
    if hashes and set(map(len, hashes)) != {BLOCK_HASH_BYTES}:  # in C: thousands of keys
        i, n = next((i, len(h)) for i, h in enumerate(hashes) if len(h) != BLOCK_HASH_BYTES)
        raise ValueError(f"block_hashes[{i}] is {n} bytes, expected {BLOCK_HASH_BYTES}")


class RouteRefused(Exception):
    """A route that fails with a grpc status (Route aborts with it; RouteBatch answers it in
    that request's outcome)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class MasterServicer(master_pb2_grpc.MasterServicer):
    def __init__(
        self,
        view: ClusterView,
        policy: Policy,
        leases: RequestLeases | None = None,
        exchange: ChargeExchange | None = None,
    ) -> None:
        self.view = view
        self.policy = policy
        self.leases = leases if leases is not None else RequestLeases()
        self.exchange = exchange  # shares this master's route charges with the others

    async def Route(
        self, request: master_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.RoutePlan:
        try:
            plan = self._route(request, trace.get_current_span())
        except RouteRefused as e:
            await context.abort(e.code, e.details)
        if self.exchange is not None:
            await self.exchange.publish_routed()
        return plan

    async def RouteBatch(
        self, request: master_pb2.RouteBatchRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.RouteBatchReply:
        """The releases, then each route as Route would answer it, in order; their charges
        published once."""
        if len(request.requests) > MAX_BATCH:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"too many requests in one batch ({len(request.requests)} > {MAX_BATCH})",
            )
        for ended in request.releases:
            self.leases.release(ended.request_id, ended.frontend_id)
        trace.get_current_span().set_attribute("rtp.route.batch_size", len(request.requests))
        reply = master_pb2.RouteBatchReply()
        for item in request.requests:
            outcome = reply.outcomes.add()
            try:
                outcome.plan.CopyFrom(self._route(item, trace.INVALID_SPAN))
            except RouteRefused as e:
                outcome.code, outcome.details = e.code.value[0], e.details
        if request.requests:
            metrics.master().route_batch(len(request.requests))
        if self.exchange is not None and request.requests:
            await self.exchange.publish_routed()
        return reply

    def _route(self, request: master_pb2.RouteRequest, span: trace.Span) -> master_pb2.RoutePlan:
        """Validate, lease and decide one route (its attributes on `span`: the call's, or
        none for a route of a batch); raises RouteRefused."""
        started, started_cpu = time.perf_counter(), time.thread_time()
        span.set_attribute(tracing.REQUEST_ID, request.request_id)
        extra = {"request_id": request.request_id}
        try:
            validate(request)
        except ValueError as e:
            raise RouteRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        leased = bool(request.request_id and request.frontend_id)
        if leased:
            holder = self.leases.acquire(
                request.request_id, request.frontend_id, gone=self.view.departed
            )
            if holder is not None:
                log.warning("route %s: in flight through %s", request.request_id, holder)
                raise RouteRefused(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"a request with id {request.request_id!r} is in flight through another "
                    "frontend; wait for it to end (or send another id)",
                )
        try:
            decision = self.policy.decide(self.view, request)
        except NoWorkersError as e:
            if leased:
                self.leases.release(request.request_id, request.frontend_id)
            metrics.master().route(self.policy.name, RouteReason.NO_WORKERS)
            log.warning("route %s: %s", request.request_id, e, extra=extra)
            raise RouteRefused(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        plan = decision.plan
        metrics.master().route(plan.policy, decision.reason)
        metrics.master().routed_in(time.perf_counter() - started, time.thread_time() - started_cpu)
        log.debug("route %s: %s", request.request_id, plan.reason, extra=extra)
        if span.is_recording():
            span.set_attributes(
                {
                    "rtp.route.policy": plan.policy,
                    "rtp.route.reason": plan.reason,
                    "rtp.route.prefill": plan.prefill.id,
                    "rtp.route.decode": plan.decode.id,
                    "rtp.route.matched_blocks": plan.matched_blocks,
                    "rtp.route.prompt_blocks": len(route_hashes(request)),
                }
            )
        return plan

    async def Release(
        self, request: master_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.ReleaseReply:
        released = self.leases.release(request.request_id, request.frontend_id)
        return master_pb2.ReleaseReply(released=released)

    async def Index(
        self, request: master_pb2.IndexRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.IndexReply:
        view = self.view
        known = set(view.index.workers()) | set(view.sync.workers())
        wanted = known & set(request.worker_ids) if request.worker_ids else known
        reply = master_pb2.IndexReply()
        for worker_id in sorted(wanted):
            incarnation, seq = view.sync.position(worker_id)
            state = view.sync.state(worker_id)
            entry = reply.workers.add(
                worker_id=worker_id,
                incarnation=incarnation,
                seq=seq,
                state=state.value if state is not None else "",
                num_blocks=view.index.num_blocks(worker_id),
                num_host_blocks=view.index.host.num_blocks(worker_id),
            )
            if not request.counts_only:
                entry.block_hashes.extend(sorted(view.index.hashes(worker_id)))
                entry.host_block_hashes.extend(sorted(view.index.host.hashes(worker_id)))
        return reply
