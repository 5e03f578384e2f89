"""The local actuator: worker processes on this machine, started and stopped by the planner.

Each worker is `rtp-serve <role> ... --worker-id <id>` (or `rtp-serve sim-worker --role
<role> --count 1 ...`), a child that dies with the planner (PR_SET_PDEATHSIG). Its member id
is the id given here, so the planner's victims (member ids, least loaded first) name the
processes to stop. A stop is SIGTERM only (services/planner/actuator.py: drain, then exit);
a worker still running drain_timeout + STOP_SLACK_S after it is killed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rtp_serve.services.planner.actuator import ROLES

log = logging.getLogger(__name__)

STOP_SLACK_S = 2.0
Argv = Callable[[str, str], list[str]]  # (role, worker id) -> the worker's command line
Spawn = Callable[[list[str]], subprocess.Popen]


@dataclass(slots=True)
class _Worker:
    role: str
    worker_id: str
    proc: subprocess.Popen
    started: float
    stopping_since: float | None = None
    killed: bool = False


class LocalActuator:
    name = "local"

    def __init__(self, argv: Argv, spawn: Spawn, drain_timeout_s: float, prefix: str = "") -> None:
        self._argv = argv
        self._spawn = spawn
        self._drain_timeout_s = drain_timeout_s
        self._prefix = prefix or f"w{os.getpid()}"
        self._ids = itertools.count()
        self._workers: list[_Worker] = []
        self.started = 0
        self.stopped = 0

    async def replicas(self) -> dict[str, int]:
        self._reap()
        out = dict.fromkeys(ROLES, 0)
        for w in self._workers:
            if w.stopping_since is None:
                out[w.role] += 1
        return out

    def running(self) -> list[tuple[str, str, int]]:
        """(role, worker id, pid) of every worker process alive, stopping ones included."""
        self._reap()
        return [(w.role, w.worker_id, w.proc.pid) for w in self._workers]

    async def scale(self, role: str, target: int, victims: Sequence[str] = ()) -> None:
        if role not in ROLES or target < 0:
            raise ValueError(f"cannot scale {role!r} to {target}")
        self._reap()
        serving = [w for w in self._workers if w.role == role and w.stopping_since is None]
        for _ in range(target - len(serving)):
            await asyncio.to_thread(self._start, role)
        surplus = len(serving) - target
        if surplus > 0:
            for w in self._pick(serving, victims, surplus):
                self._stop(w)

    async def close(self) -> None:
        """Stop every worker (SIGTERM: they drain) and wait for them, killing what outlives
        the drain."""
        for w in self._workers:
            if w.stopping_since is None:
                self._stop(w)
        deadline = time.monotonic() + self._drain_timeout_s + STOP_SLACK_S
        while self._workers and time.monotonic() < deadline:
            self._reap()
            await asyncio.sleep(0.05)
        for w in self._workers:
            log.warning(
                "worker %s (pid %d) outlived its drain; killing it", w.worker_id, w.proc.pid
            )
            w.proc.kill()
            w.proc.wait()
        self._workers.clear()

    def _start(self, role: str) -> None:
        worker_id = f"{self._prefix}-{role}-{next(self._ids)}"
        proc = self._spawn(self._argv(role, worker_id))
        self._workers.append(_Worker(role, worker_id, proc, time.monotonic()))
        self.started += 1
        log.info("started %s worker %s pid=%d", role, worker_id, proc.pid)

    def _stop(self, w: _Worker) -> None:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
        w.stopping_since = time.monotonic()
        self.stopped += 1
        log.info(
            "stopping %s worker %s pid=%d (SIGTERM: it drains)", w.role, w.worker_id, w.proc.pid
        )

    def _pick(self, serving: list[_Worker], victims: Sequence[str], n: int) -> list[_Worker]:
        """The `n` to stop: the victims' processes in their order, then the newest."""
        by_id = {w.worker_id: w for w in serving}
        chosen = [by_id[v] for v in victims if v in by_id][:n]
        rest = sorted((w for w in serving if w not in chosen), key=lambda w: -w.started)
        return chosen + rest[: n - len(chosen)]

    def _reap(self) -> None:
        now = time.monotonic()
        keep = []
        for w in self._workers:
            code = w.proc.poll()
            if code is None:
                if (
                    w.stopping_since is not None
                    and now - w.stopping_since > self._drain_timeout_s + STOP_SLACK_S
                ):
                    log.warning("worker %s outlived its drain; killing it", w.worker_id)
                    w.proc.kill()
                keep.append(w)
                continue
            if w.stopping_since is None:
                log.error(
                    "%s worker %s (pid %d) exited with %s", w.role, w.worker_id, w.proc.pid, code
                )
            else:
                log.info("%s worker %s stopped (exit %s)", w.role, w.worker_id, code)
        self._workers = keep
