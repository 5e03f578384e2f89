"""bench/cpu_use.py: CPU per output token by process, the engine's threads (named by
rtp_serve/kernels/affinity.py) counted apart, read from this machine's /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from bench import cpu_use
from rtp_serve.kernels.affinity import ENGINE_THREAD, name_thread

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")


def _spin(cpu_s: float, name: str | None, used: list[float], hold: threading.Event) -> None:
    if name:
        name_thread(name)
    t0 = time.thread_time()
    while time.thread_time() - t0 < cpu_s:
        pass
    used.append(time.thread_time() - t0)
    hold.wait()  # alive until the test has read it: a thread's /proc entry goes with it


def test_a_named_thread_counts_as_the_engine_and_the_rest_as_its_process():
    procs = {"client": [os.getpid()]}
    before = cpu_use.snapshot(procs)
    engine: list[float] = []
    other: list[float] = []
    hold = threading.Event()
    threads = [threading.Thread(target=_spin, args=(0.3, ENGINE_THREAD, engine, hold)),
               threading.Thread(target=_spin, args=(0.2, None, other, hold))]  # fmt: skip
    for t in threads:
        t.start()
    while not (engine and other):
        time.sleep(0.01)
    after = cpu_use.snapshot(procs)
    whole = cpu_use.snapshot(procs, engine_apart=False)  # as bench/route.py counts
    hold.set()
    for t in threads:
        t.join()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    used = {g: after[g] - before.get(g, 0.0) for g in after}
    assert used["engine"] == pytest.approx(engine[0], abs=3 * tick)
    assert used["client"] >= other[0] - 3 * tick  # the unnamed spinner, and the test itself
    assert used["client"] < other[0] + engine[0] / 2  # not the named one's time
    assert set(whole) == {"client"}
    assert whole["client"] == pytest.approx(after["client"] + after["engine"], abs=3 * tick)


def test_a_clusters_processes_by_service_name():
    pids = [{"name": "fused", "pid": 11}, {"name": "frontend", "pid": 12},
            {"name": "fused", "pid": 13}]  # fmt: skip
    assert cpu_use.of_cluster(pids) == {"fused": [11, 13], "frontend": [12]}


def test_descendants_take_in_a_child_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in cpu_use.descendants(os.getpid())
        assert cpu_use.descendants(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_per_token_puts_the_engine_first_and_describe_gives_the_tax():
    before = {"engine": 1.0, "frontend": 0.5, "client": 0.1}
    after = {"engine": 9.0, "frontend": 0.9, "client": 0.2, "master": 0.1}  # master: new
    us = cpu_use.per_token(before, after, output_tokens=1000)
    assert list(us) == ["engine", "frontend", "client", "master"]
    assert us == pytest.approx({"engine": 8000, "frontend": 400, "client": 100, "master": 100})
    assert cpu_use.describe(us) == (
        "CPU per output token: engine 8,000 us; beside it 600 (7.5% of the engine's) = "
        "frontend 400, client 100, master 100"
    )
    assert cpu_use.per_token(before, after, 0) == {}
    assert cpu_use.describe({"vllm": 900.0, "client": 100.0}) == (
        "CPU per output token: 1,000 us (vllm 900, client 100)"
    )
