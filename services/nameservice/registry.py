"""The membership table: who is registered, and when each member last showed signs of life.

Pure and synchronous (time comes from an injectable clock), so it is tested exactly without
a network. Every change returns the `MembershipEvent`s it causes; the service broadcasts
them to watchers and on NATS.

A member is alive while `now - last_seen < ttl`: it expires exactly `ttl` seconds after its
last register or heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rtp_serve.services.common.pb import nameservice_pb2 as pb

Event = pb.MembershipEvent

REASON_DEREGISTERED = "deregistered"
REASON_EXPIRED = "expired"
REASON_REPLACED = "replaced"  # the same id registered again with different details


def joined(member: pb.Member) -> Event:
    return Event(kind=Event.KIND_JOINED, member=member)


def left(member: pb.Member, reason: str) -> Event:
    return Event(kind=Event.KIND_LEFT, member=member, reason=reason)


def snapshot(member: pb.Member) -> Event:
    return Event(kind=Event.KIND_SNAPSHOT, member=member)


class NamespaceConflict(ValueError):
    """A worker's KV namespace (cache salt, block size) differs from that of a worker already
    registered for the same model: their block hash keys would never agree, so routing by
    cache would send requests where their prefix is not, and KV would not move between them."""

    def __init__(self, member: pb.Member, other: pb.Member) -> None:
        self.member, self.other = member, other
        super().__init__(
            f"worker {member.id} of model {member.model!r} has cache salt "
            f"{member.cache_salt.hex()} and block size {member.block_size}, but worker "
            f"{other.id} registered with cache salt {other.cache_salt.hex()} and block size "
            f"{other.block_size} (another model checkpoint, --dtype, --weight-dtype, --kv-dtype "
            "or --block-size?)"
        )


@dataclass(slots=True)
class _Entry:
    member: pb.Member
    last_seen: float


class Registry:
    """id -> member, with heartbeat expiry after `ttl` seconds."""

    def __init__(self, ttl: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        self.ttl = ttl
        self._clock = clock
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, member_id: str) -> bool:
        return member_id in self._entries

    def register(self, member: pb.Member) -> list[Event]:
        """Add or replace `member`.

        A new id: JOINED. The same id with different details (a restarted instance): LEFT
        "replaced", then JOINED. The same member again (a client re-registering after it
        lost touch with us): no event, only a fresh heartbeat.
        """
        if not member.id:
            raise ValueError("member id is required")
        self._check_namespace(member)
        member = _copy(member)
        old = self._entries.get(member.id)
        self._entries[member.id] = _Entry(member, self._clock())
        if old is None:
            return [joined(member)]
        if old.member == member:
            return []
        return [left(old.member, REASON_REPLACED), joined(member)]

    def _check_namespace(self, member: pb.Member) -> None:
        """NamespaceConflict if `member` carries a KV namespace other than a registered
        worker's of the same model (members without one, such as frontends, pass)."""
        if not member.cache_salt:
            return
        for entry in self._entries.values():
            other = entry.member
            if other.id == member.id or not other.cache_salt or other.model != member.model:
                continue
            if (other.cache_salt, other.block_size) != (member.cache_salt, member.block_size):
                raise NamespaceConflict(member, other)

    def heartbeat(self, member_id: str) -> bool:
        """Refresh `member_id`; False if it is unknown (it must register again)."""
        entry = self._entries.get(member_id)
        if entry is None:
            return False
        entry.last_seen = self._clock()
        return True

    def deregister(self, member_id: str) -> list[Event]:
        entry = self._entries.pop(member_id, None)
        return [] if entry is None else [left(entry.member, REASON_DEREGISTERED)]

    def expire(self, now: float | None = None) -> list[Event]:
        """Remove every member silent for `ttl` seconds or more; their LEFT "expired" events."""
        now = self._clock() if now is None else now
        gone = [e for e in self._entries.values() if now - e.last_seen >= self.ttl]
        for entry in gone:
            del self._entries[entry.member.id]
        return [left(entry.member, REASON_EXPIRED) for entry in gone]

    def forgive(self, seconds: float) -> None:
        """The service itself did not run for `seconds` (its process was starved or
        stopped): heartbeats sent meanwhile could not be taken, so that time does not count
        against anyone."""
        for entry in self._entries.values():
            entry.last_seen += seconds

    def members(self, role: pb.Role = pb.ROLE_UNSPECIFIED) -> list[pb.Member]:
        """Current members in registration order; ROLE_UNSPECIFIED means all roles."""
        return [
            _copy(e.member)
            for e in self._entries.values()
            if role == pb.ROLE_UNSPECIFIED or e.member.role == role
        ]

    def get(self, member_id: str) -> pb.Member | None:
        entry = self._entries.get(member_id)
        return None if entry is None else _copy(entry.member)


def _copy(member: pb.Member) -> pb.Member:
    """Members are mutable protobufs; the table never shares them with callers."""
    out = pb.Member()
    out.CopyFrom(member)
    return out
