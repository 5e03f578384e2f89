"""A whole cluster started by the launcher (`rtp-serve up`) as a real process tree."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.pb import (
    nameservice_pb2,
    nameservice_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from rtp_serve.services.launcher.process import LaunchedCluster
from rtp_serve.services.launcher.process import launch as launch_cluster


@dataclass
class Cluster(LaunchedCluster):
    """A launched cluster plus the views tests need (membership, worker stats)."""

    mode: str = ""

    @property
    def nameservice(self) -> str:
        return self.info["nameservice"]

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
        workers = self.workers()

        async def run():
            out = {}
            for m in workers:
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


@contextlib.contextmanager
def launch(model: str, tmp: Path, *flags: str, stderr: IO[str] | None = None) -> Iterator[Cluster]:
    """The launcher with a 1 s heartbeat TTL, so expiry tests run fast, and 256 MiB of KV per
    worker unless `flags` say otherwise (the machine-sized default would take GiBs per test
    cluster; tests/test_memory.py covers it). PD clusters disaggregate every prompt unless
    `flags` set --max-local-prefill-tokens: the tests' prompts are short, and what they test
    is the transfer. Every service logs to `stderr` (default: this process's)."""
    kv = () if "--kv-cache-mib" in flags else ("--kv-cache-mib", "256")
    if "--max-local-prefill-tokens" not in flags:
        kv += ("--max-local-prefill-tokens", "0")
    with launch_cluster(model, tmp, "--ttl", "1", *kv, *flags, stderr=stderr) as c:
        cluster = Cluster(c.url, c.info, c.proc)
        yield cluster
    cluster.left_running = c.left_running
