"""The nameservice process: gRPC `rtp.v1.NameService` over the membership `Registry`.

    rtp-serve nameservice --port 7000 --ttl 3 --nats-url nats://127.0.0.1:4222

Members register, heartbeat and deregister; a member silent for `--ttl` seconds is
dropped. Every join and leave goes to each `Watch` stream and to NATS
(`subjects.membership(namespace)`, payload `rtp.v1.MembershipEvent`).

A Watch stream starts with one KIND_SNAPSHOT event per current member. Its initial metadata
carries `rtp-snapshot-size`, so a client knows where the snapshot ends (see naming.py).

The registry lives in memory only. A restarted nameservice knows nobody until the members of
the cluster, which heartbeat every TTL/3, learn that it forgot them and register again; so
for 1.5 TTLs after it starts (the rejoin window: a member notices within one heartbeat
interval and its retries are as frequent, which needs 2/3 of a TTL; the rest absorbs a
starved CPU) it takes registrations and heartbeats but holds back the snapshot that opens a
Watch. A watcher that lost its stream keeps the membership it last knew meanwhile, and then
gets the whole cluster, instead of an empty snapshot that would say everyone left. (List
answers at once, with whoever is back.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from rtp_serve.services.common import grpc_util, metrics, subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.env import env
from rtp_serve.services.common.flags import add_common_flags, advertised, redact
from rtp_serve.services.common.naming import SNAPSHOT_SIZE_KEY
from rtp_serve.services.common.pb import nameservice_pb2 as pb
from rtp_serve.services.common.pb import nameservice_pb2_grpc as pb_grpc
from rtp_serve.services.nameservice import metrics as ns_metrics
from rtp_serve.services.nameservice.registry import (
    REASON_EXPIRED,
    Event,
    NamespaceConflict,
    Registry,
    snapshot,
)

log = logging.getLogger(__name__)

SERVICE_NAME = "rtp.v1.NameService"

# A watcher this far behind is cut off; its client reconnects and gets a fresh snapshot.
WATCH_QUEUE_SIZE = 4096
# The rejoin window, in TTLs (see the module docstring).
REJOIN_TTLS = 1.5
GRACE_S = 1.0


class NameService(pb_grpc.NameServiceServicer):
    def __init__(
        self, registry: Registry, bus: Bus, namespace: str, rejoin_s: float | None = None
    ) -> None:
        self.registry = registry
        self._rejoined_at = time.monotonic() + (
            REJOIN_TTLS * registry.ttl if rejoin_s is None else rejoin_s
        )
        self._bus = bus
        self._subject = subjects.membership(namespace)
        self._watchers: set[asyncio.Queue[Event | None]] = set()

    async def Register(self, request: pb.Member, context: grpc.aio.ServicerContext):
        try:
            events = self.registry.register(request)
        except NamespaceConflict as e:
            log.error("refused a worker: %s", e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self._broadcast(events)
        return pb.RegisterReply(ttl_ms=int(self.registry.ttl * 1000))

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext):
        known = self.registry.heartbeat(request.id)
        ns_metrics.nameservice().heartbeat(known)
        return pb.HeartbeatReply(known=known)

    async def Deregister(self, request: pb.DeregisterRequest, context: grpc.aio.ServicerContext):
        await self._broadcast(self.registry.deregister(request.id))
        return pb.DeregisterReply()

    async def List(self, request: pb.ListRequest, context: grpc.aio.ServicerContext):
        return pb.MemberList(members=self.registry.members(request.role))

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Event]:
        await self._rejoin_window()
        # Snapshot and subscription are taken with no await between them, so no event is
        # missed or seen twice.
        queue: asyncio.Queue[Event | None] = asyncio.Queue(WATCH_QUEUE_SIZE)
        current = self.registry.members()
        self._watchers.add(queue)
        try:
            await context.send_initial_metadata(((SNAPSHOT_SIZE_KEY, str(len(current))),))
            for member in current:
                yield snapshot(member)
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._watchers.discard(queue)

    async def _rejoin_window(self) -> None:
        """Until the members of the cluster have had the rejoin window to register again after a
        restart of this service (see the module docstring)."""
        left = self._rejoined_at - time.monotonic()
        if left > 0:
            await asyncio.sleep(left)

    async def expire_forever(self) -> None:
        """Drop silent members, checking ten times per TTL. A check that comes late by more
        than a tick means this process did not run meanwhile (a starved CPU, a stopped
        process): the heartbeats queued for it are not late, so that pause is forgiven
        before anyone is dropped (else every member would expire at once)."""
        tick = self.registry.ttl / 10
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            paused = now - last - tick
            last = now
            if paused > tick:
                self.registry.forgive(paused)
                ns_metrics.nameservice().paused(paused)
                log.warning("nameservice did not run for %.2f s; that pause counts against no "
                            "member's heartbeats", paused)  # fmt: skip
            await self._broadcast(self.registry.expire())

    def end_watches(self) -> None:
        for queue in list(self._watchers):
            _replace_with_end(queue)
        self._watchers.clear()

    async def _broadcast(self, events: list[Event]) -> None:
        for event in events:
            ns_metrics.nameservice().membership(event, expired=event.reason == REASON_EXPIRED)
            m = event.member
            log.info(
                "%s id=%s role=%s address=%s%s",
                Event.Kind.Name(event.kind).removeprefix("KIND_").lower(),
                m.id,
                pb.Role.Name(m.role),
                m.address,
                f" reason={event.reason}" if event.reason else "",
            )
            for queue in list(self._watchers):
                try:
                    queue.put_nowait(event)
                except asyncio.QueueFull:
                    log.warning("a watcher fell %d events behind; ending its stream", queue.qsize())
                    self._watchers.discard(queue)
                    _replace_with_end(queue)
            await self._bus.publish(self._subject, event)


def _replace_with_end(queue: asyncio.Queue[Event | None]) -> None:
    """Empty `queue` and leave only the end-of-stream marker in it."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(None)


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    add_common_flags(p, nameservice=False)
    p.add_argument(
        "--ttl",
        type=float,
        default=float(env("ttl", "3.0")),
        help="seconds without a heartbeat before a member is dropped",
    )


async def serve(args: argparse.Namespace) -> None:
    bus = await Bus.connect(args.nats_url, "nameservice", args.nats_token)
    service = NameService(Registry(ttl=args.ttl), bus, args.namespace)
    server, port, health = grpc_util.create_server(f"{args.host}:{args.port}")
    pb_grpc.add_NameServiceServicer_to_server(service, server)
    # Not a member of itself: its metrics address is only logged (and known to a launcher).
    metrics_port = metrics.start_metrics_server(args.metrics_port, args.host)
    expiry: asyncio.Task[None] | None = None
    try:
        await server.start()
        expiry = asyncio.create_task(service.expire_forever(), name="expire")
        await grpc_util.set_serving(health, SERVICE_NAME, True)
        log.info(
            "nameservice listening address=%s port=%d ttl=%.3gs namespace=%s nats=%s metrics=%s",
            advertised(args, port),
            port,
            args.ttl,
            args.namespace,
            redact(args.nats_url) if args.nats_url else "-",
            advertised(args, metrics_port),
        )
        await server.wait_for_termination()
    finally:
        with contextlib.suppress(Exception):
            await grpc_util.set_serving(health, SERVICE_NAME, False)
        if expiry is not None:
            expiry.cancel()
        service.end_watches()
        await server.stop(GRACE_S)
        await bus.close()
