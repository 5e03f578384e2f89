"""Run `rtp-serve up` as a child process and wait until the cluster serves (for tests,
benchmarks and scripts that need a whole cluster for a while)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rtp_serve.services.launcher.servers import free_port

# The rtp-serve command run as a child. -P keeps the working directory off sys.path: from a
# checkout's root its rtp_serve/ folder would shadow the installed package's.
CLI = (sys.executable, "-P", "-m", "rtp_serve.services.cli")

UP_TIMEOUT_S = 240.0


def _die_with_parent() -> None:
    # Linux: SIGKILL this child when its parent goes away, however it goes.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def child_process(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """A service process that dies with this one (no orphans), with `env` added to ours."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        preexec_fn=_die_with_parent,
    )


@dataclass
class LaunchedCluster:
    url: str  # http://host:port of the frontend
    info: dict  # what the launcher wrote to --info-file: addresses and pids
    proc: subprocess.Popen
    left_running: list[int] = field(default_factory=list)  # filled in after stopping

    def pids(self) -> list[int]:
        return [p["pid"] for p in self.info["pids"]]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie has exited, only not reaped yet
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z":
            return False
    return True


@contextlib.contextmanager
def launch(
    model: str,
    work_dir: Path,
    *flags: str,
    stderr: IO[str] | None = None,
    command: Sequence[str] = CLI,
) -> Iterator[LaunchedCluster]:
    """The cluster, up and ready, for the body; stopped with SIGTERM afterwards. Every
    service logs to `stderr` (default: this process's). `command` is the `rtp-serve` to run
    (another installation's script, for one)."""
    port = free_port()
    info_file = work_dir / "cluster.json"
    argv = [*command, "up", "--model", model, "--port", str(port),
            "--info-file", str(info_file), *flags]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    cluster = None
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {proc.returncode}")
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError("cluster did not come up") from None
            if line.startswith("rtp-serve is up:"):
                break
        cluster = LaunchedCluster(
            f"http://127.0.0.1:{port}", json.loads(info_file.read_text()), proc
        )
        yield cluster
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if cluster is not None:
            deadline = time.monotonic() + 10
            while any(alive(p) for p in cluster.pids()) and time.monotonic() < deadline:
                time.sleep(0.1)
            cluster.left_running = [p for p in cluster.pids() if alive(p)]
