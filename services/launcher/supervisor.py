"""What `rtp-serve up` does when one of its processes exits.

Without a restart policy (`--restart no`, the default) it says so and keeps serving with what
is left, as a degraded cluster does. With `--restart on-failure` it starts the process again
with the same command line, as a container orchestrator's restart policy would: a service
on the same ports (the nameservice, the frontend, NATS and Redis keep their addresses, the
rest register their new ones), after a backoff that doubles from BACKOFF_MIN_S to
BACKOFF_MAX_S while the process keeps dying and resets once it has stayed up for STEADY_S.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rtp_serve.services.launcher.servers import ManagedProcess

log = logging.getLogger(__name__)

RESTART_POLICIES = ("no", "on-failure")
BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 8.0
STEADY_S = 30.0

Spawn = Callable[[list[str]], subprocess.Popen]


@dataclass(slots=True)
class _Backoff:
    started_at: float  # when the process was first seen running, or last restarted
    delay: float = BACKOFF_MIN_S
    exited_at: float | None = None

    def due(self, now: float) -> bool:
        """Whether the process that exited may start again now."""
        if self.exited_at is None:
            if now - self.started_at >= STEADY_S:
                self.delay = BACKOFF_MIN_S  # it had settled: this is a new failure
            self.exited_at = now
        return now - self.exited_at >= self.delay

    def restarted(self, now: float) -> None:
        self.delay = min(self.delay * 2, BACKOFF_MAX_S)
        self.started_at, self.exited_at = now, None


@dataclass
class Supervisor:
    policy: str  # one of RESTART_POLICIES
    spawn: Spawn  # starts a child from its argv (the launcher's: dies with the launcher)
    clock: Callable[[], float] = time.monotonic
    restarts: int = 0
    _reported: set[int] = field(default_factory=set)  # pids whose exit was logged
    _backoff: dict[tuple[str, int], _Backoff] = field(default_factory=dict)

    def check(self, procs: list[tuple[str, subprocess.Popen]], infra: list[ManagedProcess]) -> bool:
        """Log what exited and, by the policy, restart it (replaced in `procs` / `infra` in
        place); True if anything was restarted."""
        now = self.clock()
        changed = False
        for slot, (name, proc) in enumerate(procs):
            backoff = self._slot(name, slot, now)
            if proc.poll() is None:
                continue
            self._exited(name, proc.pid, proc.returncode)
            if self.policy == "no" or not backoff.due(now):
                continue
            fresh = self.spawn(list(proc.args))
            procs[slot] = (name, fresh)
            backoff.restarted(now)
            self.restarts += 1
            changed = True
            log.warning("restarted %s: pid %d (was %d)", name, fresh.pid, proc.pid)
        for slot, server in enumerate(infra):
            backoff = self._slot(server.name, slot, now)
            if server.running():
                continue
            self._exited(server.name, server.pid, server.popen.returncode)
            if self.policy == "no" or not backoff.due(now):
                continue
            old = server.pid
            ok = server.restart()
            backoff.restarted(now)  # a failed attempt backs off too
            if ok:
                self.restarts += 1
                changed = True
                log.warning("restarted %s: pid %d (was %d)", server.name, server.pid, old)
        return changed

    def _exited(self, name: str, pid: int, code: int | None) -> None:
        if pid not in self._reported:
            self._reported.add(pid)
            what = "restarting it" if self.policy != "no" else "not restarting it (--restart no)"
            log.error("%s (pid %d) exited with %s; %s", name, pid, code, what)

    def _slot(self, name: str, slot: int, now: float) -> _Backoff:
        backoff = self._backoff.get((name, slot))
        if backoff is None:
            backoff = self._backoff[(name, slot)] = _Backoff(started_at=now)
        return backoff
