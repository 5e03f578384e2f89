"""The nameservice's metric families: heartbeats, members by role, expirations."""

from __future__ import annotations

from rtp_serve.services.common.metrics import Families, MetricSpec, default_families, role_label
from rtp_serve.services.common.pb import nameservice_pb2


class NameServiceMetrics(Families):
    SPECS = (
        MetricSpec(
            "heartbeats", "counter", "heartbeats",
            "Heartbeats received (known=false: from a member already dropped, which must "
            "register again).",
            ("known",),
        ),
        MetricSpec(
            "heartbeats_missed", "counter", "heartbeats_missed",
            "Members dropped because their heartbeats stopped for a whole TTL.",
            ("role",),
        ),
        MetricSpec(
            "pauses", "counter", "nameservice_pause_seconds",
            "Time this process did not run (its expiry checks came late), forgiven to every "
            "member's heartbeat deadline.",
        ),
        MetricSpec("members", "gauge", "members", "Registered members by role.", ("role",)),
    )  # fmt: skip

    def heartbeat(self, known: bool) -> None:
        self.heartbeats.labels("true" if known else "false").inc()

    def paused(self, seconds: float) -> None:
        self.pauses.inc(seconds)

    def membership(self, event: nameservice_pb2.MembershipEvent, expired: bool) -> None:
        """Account one broadcast membership change (`expired`: a LEFT for silence)."""
        role = role_label(event.member.role)
        if event.kind == nameservice_pb2.MembershipEvent.KIND_JOINED:
            self.members.labels(role).inc()
        elif event.kind == nameservice_pb2.MembershipEvent.KIND_LEFT:
            self.members.labels(role).dec()
            if expired:
                self.heartbeats_missed.labels(role).inc()


def nameservice() -> NameServiceMetrics:
    return default_families(NameServiceMetrics)
