"""The launcher's restart policy (services/launcher/supervisor.py) over real processes: a
child that exits is started again with the same command line after a backoff that doubles
while it keeps dying and resets once it stayed up; a server (a real nats-server) comes back
on its port; `--restart no` only reports."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from rtp_serve.services.launcher import servers, supervisor
from rtp_serve.services.launcher.servers import start_nats
from rtp_serve.services.launcher.supervisor import Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def test_a_dead_child_comes_back_with_its_argv_after_a_doubling_backoff():
    clock = Clock()
    sup = Supervisor("on-failure", _spawn, clock)
    procs = [("worker", _spawn(SLEEPER)), ("other", _spawn(SLEEPER))]
    try:
        assert not sup.check(procs, [])  # all running: nothing to do
        first = procs[0][1]
        _kill(first)
        assert not sup.check(procs, [])  # exited just now: the backoff runs first
        clock.now += supervisor.BACKOFF_MIN_S
        assert sup.check(procs, [])
        second = procs[0][1]
        assert second.pid != first.pid and second.args == first.args and second.poll() is None
        assert procs[1][1].poll() is None and sup.restarts == 1

        _kill(second)  # dies again at once: twice the wait
        assert not sup.check(procs, [])
        clock.now += supervisor.BACKOFF_MIN_S
        assert not sup.check(procs, [])
        clock.now += supervisor.BACKOFF_MIN_S
        assert sup.check(procs, [])

        clock.now += supervisor.STEADY_S  # up long enough: a new failure starts over
        _kill(procs[0][1])
        assert not sup.check(procs, [])
        clock.now += supervisor.BACKOFF_MIN_S
        assert sup.check(procs, []) and sup.restarts == 3
    finally:
        for _, proc in procs:
            _kill(proc)


def test_without_a_restart_policy_a_dead_child_stays_dead():
    clock = Clock()
    sup = Supervisor("no", _spawn, clock)
    procs = [("worker", _spawn(SLEEPER))]
    dead = procs[0][1]
    _kill(dead)
    clock.now += supervisor.BACKOFF_MAX_S
    assert not sup.check(procs, []) and procs[0][1] is dead and sup.restarts == 0


def test_a_killed_server_comes_back_on_its_port(tmp_path):
    nats = start_nats(tmp_path)
    clock = Clock()
    sup = Supervisor("on-failure", _spawn, clock)
    try:
        old = nats.pid
        nats.popen.kill()
        nats.popen.wait()
        assert not sup.check([], [nats])
        clock.now += supervisor.BACKOFF_MIN_S
        assert sup.check([], [nats])
        assert nats.pid != old and nats.running()
        with socket.create_connection(("127.0.0.1", nats.port), 2) as s:
            assert s.recv(8).startswith(b"INFO")  # the same URL serves again
    finally:
        nats.stop()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_nats_runs_with_a_tighter_go_gc_unless_told_otherwise(tmp_path, monkeypatch):
    """The launcher's GOGC for nats-server, kept across a restart; the environment's wins."""
    monkeypatch.delenv("GOGC", raising=False)
    nats = start_nats(tmp_path / "default")
    try:
        assert _environ(nats.pid)["GOGC"] == servers.NATS_GOGC
        assert nats.restart()
        assert _environ(nats.pid)["GOGC"] == servers.NATS_GOGC
    finally:
        nats.stop()
    monkeypatch.setenv("GOGC", "200")
    nats = start_nats(tmp_path / "set")
    try:
        assert _environ(nats.pid)["GOGC"] == "200"
    finally:
        nats.stop()
