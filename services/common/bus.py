"""Typed NATS publisher/subscriber: services publish and receive protobuf messages, never bytes.

NATS carries cluster events only (membership, KV events, load reports), so losing it must
degrade a service, never break it:

- `Bus.connect(None, ...)` is a disabled bus: publish and subscribe do nothing.
- If NATS is down at start, `connect` returns anyway and keeps connecting in the background;
  subscriptions made meanwhile take effect once it connects.
- While disconnected, `publish` drops the message and counts it (`dropped`); it never raises.
- nats-py replays subscriptions after a reconnect, so handlers keep receiving; what was
  published meanwhile is lost, so `on_reconnected` callbacks run once the server has the
  subscriptions again (the master resyncs its prefix index there).

A token (`--nats-token`) or user:password in the URL authenticates the connection; neither
is ever logged. Subject names come from `rtp_serve.services.common.subjects` only. A message published inside a
trace carries its W3C context in NATS headers, and the subscriber's handler runs in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import AuthorizationError

from rtp_serve.services.common import tracing
from rtp_serve.services.common.flags import redact

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
Handler = Callable[[M, dict[str, str]], Awaitable[None]]

RECONNECT_WAIT_S = 0.5
CONNECT_TIMEOUT_S = 1.0
CLOSE_TIMEOUT_S = 2.0


@dataclass(slots=True)
class _Subscription(Generic[M]):
    subject: str
    message_type: type[M]
    handler: Handler[M]


class Bus:
    """One NATS connection per service; see the module docstring for failure behaviour."""

    def __init__(self, client: Client | None, name: str, token: str | None = None) -> None:
        self._nc = client
        self._name = name
        self._token = token
        self._connecting: asyncio.Task[None] | None = None
        self._pending: list[_Subscription] = []  # subscribed before the first connect
        self._outage_logged = False
        self._first_failure = asyncio.Event()
        self._closing = False
        self._reconnected: list[Callable[[], Awaitable[None]]] = []
        self.published = 0
        self.dropped = 0

    @classmethod
    async def connect(cls, url: str | None, name: str, token: str | None = None) -> Bus:
        """A bus connected to `url` (authenticated by `token` if given), or still connecting
        in the background if NATS is down; a disabled bus if `url` is None."""
        if url is None:
            log.info("no NATS url: cluster events are disabled for %s", name)
            return cls(None, name)
        bus = cls(Client(), name, token)
        bus._connecting = asyncio.create_task(bus._connect(url), name=f"nats-connect-{name}")
        # Return once connected or once the first attempt failed (no waiting on a dead NATS).
        failed = asyncio.create_task(bus._first_failure.wait())
        await asyncio.wait(
            {bus._connecting, failed},
            timeout=CONNECT_TIMEOUT_S,
            return_when=asyncio.FIRST_COMPLETED,
        )
        failed.cancel()
        if not bus._connecting.done():
            log.warning(
                "NATS at %s unreachable; %s keeps retrying in the background", redact(url), name
            )
        return bus

    @property
    def enabled(self) -> bool:
        return self._nc is not None

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def publish(
        self, subject: str, message: Message, headers: dict[str, str] | None = None
    ) -> None:
        """Send `message` on `subject`; dropped (and counted) if NATS is not connected."""
        if self._nc is None:
            return
        if not self._nc.is_connected:
            self.dropped += 1
            return
        headers = tracing.inject_headers(headers)
        try:
            await self._nc.publish(subject, message.SerializeToString(), headers=headers)
        except Exception as e:  # a dead connection must not reach the caller
            self.dropped += 1
            log.debug("NATS publish on %s dropped: %r", subject, e)
            return
        self.published += 1

    async def subscribe(self, subject: str, message_type: type[M], handler: Handler[M]) -> None:
        """Call `handler(message, headers)` for each message on `subject`, parsed as
        `message_type`. Undecodable payloads and handler exceptions are logged and skipped.
        When connected, the server has the subscription by the time this returns."""
        if self._nc is None:
            return
        sub = _Subscription(subject, message_type, handler)
        if self._connecting is not None and not self._connecting.done():
            self._pending.append(sub)  # _connect subscribes it once connected
            return
        await self._subscribe(sub)

    def on_reconnected(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Call `callback()` after each reconnect (not the first connect), once the server
        has this connection's subscriptions; its exceptions are logged."""
        self._reconnected.append(callback)

    async def flush(self, timeout: float = 1.0) -> None:
        """Wait until the server has processed everything sent so far; no-op when not
        connected, and it never raises."""
        if not self.connected:
            return
        assert self._nc is not None
        try:
            # nats-py 2.16's flush() writes its PING straight to the socket, overtaking
            # commands its flusher task has not written yet, so a PONG alone does not prove
            # the server saw an earlier SUB or PUB. Let the flusher drain its queue first.
            flush_pending = getattr(self._nc, "_flush_pending", None)
            if flush_pending is not None:
                await asyncio.wait_for(flush_pending(force_flush=True), timeout)
            await self._nc.flush(timeout)
        except Exception as e:
            log.debug("NATS flush for %s failed: %r", self._name, e)

    async def close(self) -> None:
        if self._nc is None:
            return
        self._closing = True
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connecting
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._nc.close(), CLOSE_TIMEOUT_S)
        self._nc = None

    async def _connect(self, url: str) -> None:
        assert self._nc is not None
        # With max_reconnect_attempts=-1, nats-py retries the first connect forever too.
        await self._nc.connect(
            url,
            name=self._name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=RECONNECT_WAIT_S,
            connect_timeout=CONNECT_TIMEOUT_S,
            token=self._token,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )
        log.info("%s connected to NATS at %s", self._name, redact(url))
        self._outage_logged = False
        pending, self._pending = self._pending, []
        for sub in pending:
            await self._subscribe(sub)

    async def _subscribe(self, sub: _Subscription[M]) -> None:
        assert self._nc is not None

        async def on_message(msg: Msg) -> None:
            message = sub.message_type()
            try:
                message.ParseFromString(msg.data)
            except DecodeError:
                log.warning("undecodable %s on %s", sub.message_type.__name__, msg.subject)
                return
            headers = dict(msg.headers or {})
            try:
                with tracing.extracted(headers):
                    await sub.handler(message, headers)
            except Exception:
                log.exception("handler for %s failed", msg.subject)

        await self._nc.subscribe(sub.subject, cb=on_message)
        await self.flush()  # return once the server routes the subject to us

    async def _on_error(self, e: Exception) -> None:
        self._first_failure.set()
        if not self._outage_logged and not self._closing:
            self._outage_logged = True
            if _refused_credentials(e):
                # Not an outage: retrying never helps until the configuration changes, and
                # meanwhile every event this service publishes or awaits is lost.
                log.error(
                    "NATS refused %s's credentials (%r): cluster events are off until it is "
                    "given the right --nats-token (RTP_NATS_TOKEN)",
                    self._name,
                    e,
                )
            else:
                log.warning("NATS error for %s: %r (retrying)", self._name, e)

    async def _on_disconnected(self) -> None:
        if not self._closing:
            log.warning("%s disconnected from NATS; publishing is paused", self._name)

    async def _on_reconnected(self) -> None:
        self._outage_logged = False
        log.info("%s reconnected to NATS", self._name)
        # nats-py calls this after replaying the subscriptions and a PING/PONG: the server
        # routes our subjects to us again from here on.
        for callback in self._reconnected:
            try:
                await callback()
            except Exception:
                log.exception("reconnect callback of %s failed", self._name)


def _refused_credentials(e: Exception) -> bool:
    """The server refused the token (or user:password): nats-py raises AuthorizationError
    once connected, a plain Error naming it during the first connect."""
    return isinstance(e, AuthorizationError) or "authorization violation" in str(e).lower()
