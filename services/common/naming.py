"""Nameservice client used by every service: register + heartbeat, list, watch.

    names = NameClient(args.nameservice)
    await names.register(make_member(pb.ROLE_DECODE, advertised(args, port)))
    ...
    await names.close()  # deregisters

A dead nameservice degrades a service, never crashes it: heartbeats keep retrying, the
member is registered again as soon as the nameservice answers (it may have restarted and
forgotten everyone), and `watch()` reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.kv_namespace import KVNamespace
from rtp_serve.services.common.pb import nameservice_pb2 as pb
from rtp_serve.services.common.pb import nameservice_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Watch's initial metadata: how many KIND_SNAPSHOT events open the stream.
SNAPSHOT_SIZE_KEY = "rtp-snapshot-size"
# LEFT reason made up by watch(): the member vanished while the stream was reconnecting.
REASON_LOST = "lost"
DEFAULT_TTL_S = 3.0
RPC_TIMEOUT_S = 1.0
WATCH_BACKOFF_S = (0.1, 2.0)  # first and largest wait between Watch reconnects
WORKER_ROLES = frozenset((pb.ROLE_PREFILL, pb.ROLE_DECODE, pb.ROLE_FUSED))
# Register's answers that retrying cannot change: the member itself is wrong (a missing id;
# a KV namespace other than the registered workers' of its model).
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


def make_member(
    role: pb.Role,
    address: str,
    model: str = "",
    capacity: int = 0,
    metrics_address: str = "",
    member_id: str | None = None,
    kv: KVNamespace | None = None,
) -> pb.Member:
    """A member with `member_id`, else a fresh unique id such as "decode-3f2a9c1b". Workers
    give `kv`, the KV namespace of their model (the frontend hashes prompts with it)."""
    role_name = pb.Role.Name(role).removeprefix("ROLE_").lower()
    member = pb.Member(
        id=member_id or f"{role_name}-{uuid.uuid4().hex[:8]}",
        role=role,
        address=address,
        model=model,
        capacity=capacity,
        metrics_address=metrics_address,
    )
    return member if kv is None else kv.stamp(member)


class MemberSet:
    """The members a membership event stream describes: the one fold of such a stream that
    every follower keeps (LEFT removes a member; JOINED and SNAPSHOT add or replace it)."""

    def __init__(self) -> None:
        self.members: dict[str, pb.Member] = {}

    def apply(self, event: pb.MembershipEvent) -> None:
        if event.kind == pb.MembershipEvent.KIND_LEFT:
            self.members.pop(event.member.id, None)
        elif event.member.id:
            self.members[event.member.id] = event.member

    def with_role(self, role: int, exclude: frozenset[str] = frozenset()) -> list[pb.Member]:
        """Members of `role` (not in `exclude`), ordered by id."""
        return sorted(
            (m for m in self.members.values() if m.role == role and m.id not in exclude),
            key=lambda m: m.id,
        )


class NameClient:
    def __init__(self, address: str, rpc_timeout: float = RPC_TIMEOUT_S) -> None:
        self.address = address
        self._rpc_timeout = rpc_timeout
        self._channel: grpc.aio.Channel | None = None
        self._member: pb.Member | None = None
        self._registered = False
        self._outage = False  # an unreachable nameservice is logged once per outage
        self._refused = False  # so is a refusal to take us back
        self._ttl = DEFAULT_TTL_S
        self._keepalive: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # old channels being closed

    @property
    def member(self) -> pb.Member | None:
        return self._member

    @property
    def registered(self) -> bool:
        """True if the last register or heartbeat reached the nameservice and it knew us."""
        return self._registered

    async def register(self, member: pb.Member) -> None:
        """Register `member` and keep it alive with heartbeats every ttl/3 until `close()`.
        If the nameservice is unreachable this logs, and the heartbeat task retries; if it
        refuses the member (REFUSED), the grpc.aio.AioRpcError is raised."""
        if self._keepalive is not None:
            raise RuntimeError("a NameClient registers one member")
        self._member = member
        try:
            await self._register_once()
        except grpc.aio.AioRpcError as e:
            if e.code() in REFUSED:
                raise
            self._unreachable(e)
        self._keepalive = asyncio.create_task(self._keep_alive(), name=f"heartbeat-{member.id}")

    async def list(self, role: pb.Role = pb.ROLE_UNSPECIFIED) -> list[pb.Member]:
        """Current members (all roles for ROLE_UNSPECIFIED). Raises grpc.aio.AioRpcError if
        the nameservice does not answer within the RPC timeout."""
        try:
            reply = await self._stub().List(pb.ListRequest(role=role), timeout=self._rpc_timeout)
        except grpc.aio.AioRpcError:
            self._reset_channel()
            raise
        return list(reply.members)

    async def watch(self) -> AsyncIterator[pb.MembershipEvent]:
        """Membership events, forever: a snapshot of current members (KIND_SNAPSHOT), then
        JOINED/LEFT as they happen.

        After a lost connection it reconnects with backoff and emits the snapshot again,
        followed by LEFT (reason "lost") for members it had reported that are gone now.
        """
        reported = MemberSet()  # the members our caller believes in
        backoff = WATCH_BACKOFF_S[0]
        failures = 0
        while True:
            channel = grpc_util.channel(self.address)
            try:
                call = pb_grpc.NameServiceStub(channel).Watch(pb.WatchRequest())
                metadata = dict(await call.initial_metadata())
                # A call that failed before the stream opened has no initial metadata (and
                # raises below): that is no empty snapshot, and nobody is lost because of it.
                size = metadata.get(SNAPSHOT_SIZE_KEY)
                pending = int(size) if size is not None else -1
                if size is not None:
                    failures, backoff = 0, WATCH_BACKOFF_S[0]
                in_snapshot: set[str] = set()
                if pending == 0:
                    for gone in _lost(reported, in_snapshot):
                        yield gone
                async for event in call:
                    reported.apply(event)
                    yield event
                    if event.kind == pb.MembershipEvent.KIND_SNAPSHOT:
                        in_snapshot.add(event.member.id)
                        pending -= 1
                        if pending == 0:
                            for gone in _lost(reported, in_snapshot):
                                yield gone
                log.info("nameservice ended the watch stream; reconnecting")
            except grpc.aio.AioRpcError as e:
                failures += 1
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "watch on nameservice %s failed (%s); reconnecting",
                    self.address,
                    e.code().name,
                )
            finally:
                await channel.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, WATCH_BACKOFF_S[1])

    async def close(self, deregister: bool = True) -> None:
        """Stop heartbeats and (unless `deregister` is False) deregister, best effort."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        if deregister and self._member is not None:
            request = pb.DeregisterRequest(id=self._member.id)
            try:
                await self._stub().Deregister(request, timeout=self._rpc_timeout)
            except grpc.aio.AioRpcError as e:
                log.warning("could not deregister %s: %s", self._member.id, e.code().name)
        self._registered = False
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> NameClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _register_once(self, timeout: float | None = None) -> None:
        assert self._member is not None
        try:
            reply = await self._stub().Register(
                self._member, timeout=self._rpc_timeout if timeout is None else timeout
            )
        except grpc.aio.AioRpcError:
            self._reset_channel()
            raise
        if reply.ttl_ms:
            self._ttl = reply.ttl_ms / 1000
        if not self._registered:
            log.info("registered %s at %s", self._member.id, self.address)
        self._registered = True
        self._outage = self._refused = False

    async def _keep_alive(self) -> None:
        assert self._member is not None
        request = pb.HeartbeatRequest(id=self._member.id)
        while True:
            await asyncio.sleep(self._ttl / 3)
            # No attempt outlasts one heartbeat interval: one stuck on a connection opened
            # while the nameservice was starting must not hold back the next.
            timeout = min(self._rpc_timeout, self._ttl / 3)
            try:
                if self._registered:
                    reply = await self._stub().Heartbeat(request, timeout=timeout)
                    if reply.known:
                        continue
                    log.warning("nameservice forgot %s; registering again", self._member.id)
                    self._registered = False
                await self._register_once(timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() in REFUSED:  # e.g. a restarted nameservice met others first
                    level = logging.DEBUG if self._refused else logging.ERROR
                    log.log(level, "nameservice refused %s: %s", self._member.id, e.details())
                    self._refused, self._registered = True, False
                    continue
                self._reset_channel()
                self._unreachable(e)
            except Exception:  # the heartbeat must outlive any surprise
                log.exception("heartbeat for %s failed", self._member.id)

    def _unreachable(self, e: grpc.aio.AioRpcError) -> None:
        if not self._outage:
            self._outage = True
            log.warning(
                "nameservice %s unreachable (%s); retrying every %.2gs",
                self.address,
                e.code().name,
                self._ttl / 3,
            )
        self._registered = False

    def _stub(self) -> pb_grpc.NameServiceStub:
        if self._channel is None:
            self._channel = grpc_util.channel(self.address)
        return pb_grpc.NameServiceStub(self._channel)

    def _reset_channel(self) -> None:
        """Drop a channel after a failure: a fresh one connects at once, where the old one
        would wait out gRPC's reconnect backoff (which grows to minutes)."""
        old, self._channel = self._channel, None
        if old is not None:
            task = asyncio.get_running_loop().create_task(old.close(grace=1.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


def _lost(reported: MemberSet, alive: set[str]) -> list[pb.MembershipEvent]:
    """LEFT events for (and removal of) reported members missing from a fresh snapshot."""
    lost = [
        pb.MembershipEvent(kind=pb.MembershipEvent.KIND_LEFT, member=m, reason=REASON_LOST)
        for member_id, m in sorted(reported.members.items())
        if member_id not in alive
    ]
    for event in lost:
        reported.apply(event)
    return lost
