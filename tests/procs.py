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
# A small worker: one thread, a 16 MiB KV pool.
SMALL_WORKER = ("--threads", "1", "--kv-cache-mib", "16")


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
def worker_roles(model: str) -> Iterator[dict[str, str]]:
    """A small fused, prefill and decode worker of `model` (no nameservice): their
    addresses by role."""
    flags = ("--model", model, *SMALL_WORKER)
    with (
        grpc_service("fused", *flags) as (fused, _),
        grpc_service("prefill", *flags) as (prefill, _),
        grpc_service("decode", *flags) as (decode, _),
    ):
        yield {"fused": fused, "prefill": prefill, "decode": decode}


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
