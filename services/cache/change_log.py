"""`ChangeLog`: the keys a cache tier stored and removed since its feed last took them, in
order, and a callback at the first change after each take (the instance's KV feed sleeps
until told, services/common/kv_feed.py). Used by the memory tier (lru.py) and the record of
Redis's keys (redis_keys.py). Not thread-safe: one event loop records and takes."""

from __future__ import annotations

from collections.abc import Callable

Change = tuple[bytes, bool]  # (key, stored); False: removed


class ChangeLog:
    def __init__(self) -> None:
        self._changes: list[Change] = []
        # Called when a change is recorded with none waiting (the first since the last take).
        self.on_change: Callable[[], None] | None = None

    def record(self, key: bytes, stored: bool) -> None:
        if not self._changes and self.on_change is not None:
            self.on_change()
        self._changes.append((key, stored))

    def take(self) -> list[Change]:
        """Every change since the last call, in order."""
        changes, self._changes = self._changes, []
        return changes

    def __bool__(self) -> bool:
        """Whether `take` would return any."""
        return bool(self._changes)
