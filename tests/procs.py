"""Start rtp-serve service processes for tests, and wait for them properly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.tls import TlsConfig
from rtp_serve.services.launcher.servers import free_port

START_TIMEOUT_S = 60.0


def spawn(name: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "rtp_serve.services.cli", name, *flags]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def wait_grpc(
    address: str,
    proc: subprocess.Popen,
    timeout: float = START_TIMEOUT_S,
    tls: TlsConfig | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {address} exited with {proc.returncode}")
        if asyncio.run(grpc_util.check_health(address, timeout=0.5, tls=tls)):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{address} not healthy after {timeout} s")


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def grpc_service(
    name: str, *flags: str, tls: TlsConfig | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A service on a free port, healthy before the body runs, stopped (SIGTERM) after;
    `tls`: the certificate to check its health with."""
    port = free_port()
    proc = spawn(name, "--port", str(port), *flags)
    address = f"127.0.0.1:{port}"
    try:
        wait_grpc(address, proc, tls=tls)
        yield address, proc
    finally:
        stop(proc)
