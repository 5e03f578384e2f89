"""Every NATS subject of the cluster, built in one place.

Subjects follow Dynamo's hierarchical naming: `rtp.<namespace>.<event>.<instance>`, so a
subscriber takes one instance or all of them with a `*` wildcard.
"""

from __future__ import annotations

DEFAULT_NAMESPACE = "default"


def _check(token: str) -> str:
    if not token or any(c in token for c in " .*>"):
        raise ValueError(f"invalid subject token {token!r}")
    return token


def kv_events(worker_id: str, namespace: str = DEFAULT_NAMESPACE) -> str:
    """A worker's prefix-cache stored/removed events (rtp.v1.KVEvents)."""
    return f"rtp.{_check(namespace)}.kv.{_check(worker_id)}"


def kv_events_all(namespace: str = DEFAULT_NAMESPACE) -> str:
    return f"rtp.{_check(namespace)}.kv.*"


def load_report(worker_id: str, namespace: str = DEFAULT_NAMESPACE) -> str:
    """A worker's periodic load (rtp.v1.LoadReport)."""
    return f"rtp.{_check(namespace)}.load.{_check(worker_id)}"


def load_report_all(namespace: str = DEFAULT_NAMESPACE) -> str:
    return f"rtp.{_check(namespace)}.load.*"


def route_charges(namespace: str = DEFAULT_NAMESPACE) -> str:
    """The charges of the routes each master replica makes (rtp.v1.RouteCharges)."""
    return f"rtp.{_check(namespace)}.charges"


def membership(namespace: str = DEFAULT_NAMESPACE) -> str:
    """Joins and leaves published by the nameservice (rtp.v1.MembershipEvent)."""
    return f"rtp.{_check(namespace)}.members"
