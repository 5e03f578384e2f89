"""rtp.v1.Master over gRPC: validate the request, ask the policy, map errors to status codes."""

from __future__ import annotations

import logging

import grpc

from services.common.pb import master_pb2, master_pb2_grpc
from services.master.cluster import ClusterView
from services.master.policy import NoWorkersError, Policy
from services.master.prefix_index import BLOCK_HASH_BYTES

log = logging.getLogger(__name__)

MAX_BLOCK_HASHES = 1 << 20  # ~16M tokens at 16 per block: anything longer is a broken client


def validate(request: master_pb2.RouteRequest) -> None:
    """Raises ValueError naming the first bad field."""
    if len(request.block_hashes) > MAX_BLOCK_HASHES:
        raise ValueError(f"too many block_hashes ({len(request.block_hashes)})")
    for i, h in enumerate(request.block_hashes):
        if len(h) != BLOCK_HASH_BYTES:
            raise ValueError(f"block_hashes[{i}] is {len(h)} bytes, expected {BLOCK_HASH_BYTES}")


class MasterServicer(master_pb2_grpc.MasterServicer):
    def __init__(self, view: ClusterView, policy: Policy) -> None:
        self.view = view
        self.policy = policy

    async def Route(
        self, request: master_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.RoutePlan:
        try:
            validate(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            plan = self.policy.route(self.view, request)
        except NoWorkersError as e:
            log.warning("route %s: %s", request.request_id, e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        log.debug("route %s: %s", request.request_id, plan.reason)
        return plan
