"""Generation requests in flight per client, bounded, so one client cannot hold every slot
of --max-concurrent.

A client is its identity: the remote address for now (HTTP: the peer's IP; gRPC: the
peer's IP), or whatever an ingress passes instead (an API key's name, once requests carry
one). Behind a proxy every client shares the proxy's address: raise the bound, or set 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rtp_serve.services.frontend.errors import ErrorKind, FrontendError


class ClientStreams:
    def __init__(self, limit: int) -> None:
        """`limit` 0: no bound."""
        if limit < 0:
            raise ValueError(f"the per-client stream limit must be >= 0, got {limit}")
        self.limit = limit
        self._open: dict[str, int] = {}

    def open(self, client: str) -> int:
        return self._open.get(client, 0)

    @contextlib.contextmanager
    def admit(self, client: str) -> Iterator[None]:
        count = self._open.get(client, 0)
        if self.limit and count >= self.limit:
            raise FrontendError(
                ErrorKind.OVERLOADED,
                f"this client already has {count} requests in flight, this server's limit "
                "per client; retry when one ends",
                code="rate_limit_exceeded",
            )
        self._open[client] = count + 1
        try:
            yield
        finally:
            left = self._open[client] - 1
            if left:
                self._open[client] = left
            else:
                del self._open[client]  # no entry per client that ever came


def grpc_peer_host(peer: str) -> str:
    """gRPC's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") without
    the port: one client however many connections it opens."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        return rest.rpartition("]")[0].lstrip("[") or rest
    return peer
