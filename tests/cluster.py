"""A whole cluster started by the launcher (`rtp-serve up`) as a real process tree."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.common import grpc_util
from services.common.pb import nameservice_pb2, nameservice_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.servers import free_port

UP_TIMEOUT_S = 240.0


@dataclass
class Cluster:
    url: str  # http://host:port
    info: dict
    proc: subprocess.Popen

    @property
    def nameservice(self) -> str:
        return self.info["nameservice"]

    def pids(self) -> list[int]:
        return [p["pid"] for p in self.info["pids"]]

    def members(self, role: int = nameservice_pb2.ROLE_UNSPECIFIED) -> list[nameservice_pb2.Member]:
        async def run():
            async with grpc_util.channel(self.nameservice) as ch:
                reply = await nameservice_pb2_grpc.NameServiceStub(ch).List(
                    nameservice_pb2.ListRequest(role=role), timeout=5
                )
                return list(reply.members)

        return asyncio.run(run())

    def workers(self) -> list[nameservice_pb2.Member]:
        roles = (
            nameservice_pb2.ROLE_PREFILL,
            nameservice_pb2.ROLE_DECODE,
            nameservice_pb2.ROLE_FUSED,
        )
        return [m for m in self.members() if m.role in roles]

    def worker_stats(self) -> dict[str, worker_pb2.WorkerStats]:
        async def run():
            out = {}
            for m in self.workers():
                async with grpc_util.channel(m.address) as ch:
                    out[m.id] = await worker_pb2_grpc.WorkerStub(ch).Stats(
                        worker_pb2.WorkerStatsRequest(), timeout=10
                    )
            return out

        return asyncio.run(run())

    def wait_idle(self, timeout: float = 10.0) -> dict[str, worker_pb2.WorkerStats]:
        """Stats once no worker holds blocks or runs requests (cancellations are async)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.worker_stats()
            if all(s.held_blocks == 0 and s.num_running == 0 for s in stats.values()):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited but is not yet reaped by its parent.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


@contextlib.contextmanager
def launch(model: str, tmp: Path, *flags: str) -> Iterator[Cluster]:
    port = free_port()
    info_file = tmp / "cluster.json"
    argv = [sys.executable, "-m", "services.cli", "up", "--model", model, "--port", str(port),
            "--ttl", "1", "--info-file", str(info_file), *flags]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
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
        cluster = Cluster(f"http://127.0.0.1:{port}", json.loads(info_file.read_text()), proc)
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
            while any(_alive(p) for p in cluster.pids()) and time.monotonic() < deadline:
                time.sleep(0.1)
            cluster.info["left_running"] = [p for p in cluster.pids() if _alive(p)]
