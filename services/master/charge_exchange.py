"""Master replicas share the charges of the routes they make.

A master charges each route to the workers it chose (ClusterView.charge) until their next
load reports count the request, so that a burst is spread before any report shows it.
With two or more masters behind the frontends, each would see only the routes it made
itself, and their predicted waits, and so their choices for the same request, would
differ by the others' share of the last report interval. Each master publishes its
charges on NATS after every route (one small RouteCharges message) and applies the
others' as they arrive: the views then differ only by the publishing delay.
"""

from __future__ import annotations

import logging

from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import events_pb2
from rtp_serve.services.master import metrics
from rtp_serve.services.master.cluster import ClusterView

log = logging.getLogger(__name__)


class ChargeExchange:
    def __init__(self, view: ClusterView, bus: Bus, master_id: str, namespace: str) -> None:
        self.view, self.bus, self.master_id = view, bus, master_id
        self.subject = subjects.route_charges(namespace)
        view.share_charges()

    async def subscribe(self) -> None:
        await self.bus.subscribe(self.subject, events_pb2.RouteCharges, self._on_charges)

    async def publish_routed(self) -> None:
        """Publish the charges made here since the last call (none: nothing sent)."""
        routed = self.view.take_routed()
        if not routed:
            return
        message = events_pb2.RouteCharges(master_id=self.master_id)
        for worker_id, tokens, blocks, unix_ms in routed:
            message.charges.add(worker_id=worker_id, tokens=tokens, blocks=blocks, unix_ms=unix_ms)
        await self.bus.publish(self.subject, message)

    async def _on_charges(self, msg: events_pb2.RouteCharges, headers: dict[str, str]) -> None:
        if msg.master_id == self.master_id:
            return  # charged when routed
        for c in msg.charges:
            self.view.charge(c.worker_id, c.tokens, c.blocks, here=False, unix_ms=c.unix_ms)
        metrics.master().shared_charges(len(msg.charges))
