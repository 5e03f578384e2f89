"""Real NATS and Redis servers for tests (the session fixtures in conftest.py use these),
plus a bounded async wait for conditions that become true over time."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from rtp_serve.services.launcher.servers import ManagedProcess, start_nats, start_redis


@contextlib.contextmanager
def nats(data_dir: Path, port: int = 0, token: str | None = None) -> Iterator[ManagedProcess]:
    """A nats-server on 127.0.0.1 (requiring `token` if given), stopped on exit."""
    proc = start_nats(data_dir, port, token)
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def redis(
    data_dir: Path, port: int = 0, maxmemory: str = "64mb", password: str | None = None
) -> Iterator[ManagedProcess]:
    """A memory-only redis-server on 127.0.0.1 (requiring `password` if given), stopped on
    exit."""
    proc = start_redis(data_dir, port, maxmemory, password)
    try:
        yield proc
    finally:
        proc.stop()


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0, what: str = "condition"
) -> float:
    """Poll `check` (sync or async) until it is true; seconds it took. TimeoutError after
    `timeout` seconds."""
    start = time.monotonic()
    delay = 0.01
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)
