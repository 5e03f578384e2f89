"""Binding the engine's threads to CPUs (rtp_serve/kernels/affinity.py): the policy, and a
real engine bound in a process of its own (a thread's mask would otherwise stay with the
test process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtp_serve.engine.config import EngineConfig
from rtp_serve.kernels import cpu
from rtp_serve.kernels.affinity import ENGINE_THREAD, cpus_to_bind, parse_cpus


def test_auto_binds_only_a_process_that_owns_as_many_cpus_as_threads():
    assert cpus_to_bind("auto", 2, {3, 1}) == [1, 3]
    assert cpus_to_bind("auto", 2, {0, 1, 2, 3}) is None  # a shared set: leave it to the OS
    assert cpus_to_bind("auto", 4, {0, 1}) is None
    assert cpus_to_bind("auto", 1, {0}) is None  # one thread: nothing moves between cores
    assert cpus_to_bind("off", 2, {0, 1}) is None


def test_a_cpu_list_gives_each_thread_one_cpu_the_process_may_run_on():
    assert parse_cpus("0-3,6") == [0, 1, 2, 3, 6]
    assert cpus_to_bind("4,6", 2, {4, 5, 6, 7}) == [4, 6]
    with pytest.raises(ValueError, match="names 3 CPUs for 2 threads"):
        cpus_to_bind("0-2", 2, {0, 1, 2})
    with pytest.raises(ValueError, match=r"may not run on: \[9\]"):
        cpus_to_bind("0,9", 2, {0, 1})
    for bad in ("cores", "3-1", "0,0", "1-", ""):
        with pytest.raises(ValueError, match="thread_binding"):
            parse_cpus(bad)


def test_the_engine_config_refuses_a_bad_binding_by_name():
    with pytest.raises(ValueError, match="thread_binding: 'all'"):
        EngineConfig(model="m", thread_binding="all")
    assert EngineConfig(model="m", thread_binding="0-1").thread_binding == "0-1"


BOUND = """
import asyncio, json, os, threading, sys
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.engine.async_llm import AsyncLLM
from rtp_serve.engine.config import EngineConfig

def mask(tid):
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(l.split()[1] for l in f if l.startswith("Cpus_allowed_list"))

llm = AsyncLLM(EngineConfig(model=sys.argv[1], num_kv_blocks=64, num_threads=2,
                            thread_binding=sys.argv[2]))
engine_tid = asyncio.run(llm.call(lambda engine: threading.get_native_id()))

async def generate():  # the bound engine serves
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    async for out in llm.generate([1, 2, 3, 4, 5], params):
        pass
    assert out.finished

asyncio.run(generate())
masks = {tid: mask(tid) for tid in os.listdir("/proc/self/task")}
names = {tid: open(f"/proc/self/task/{tid}/comm").read().strip() for tid in masks}
main = str(threading.get_native_id())
print(json.dumps({"bound": llm.bound_cpus, "engine": masks[str(engine_tid)],
                  "main": masks[main], "masks": sorted(masks.values()),
                  "engine_name": names[str(engine_tid)], "main_name": names[main],
                  "names_on": {m: sorted(names[t] for t in masks if masks[t] == m)
                               for m in set(masks.values())}}))
llm.shutdown()
"""


@pytest.mark.skipif(cpu.load() is None, reason="binding goes through the compiled kernels")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_an_engine_binds_its_own_threads_and_nothing_else(model_dir):
    """thread_binding "a,b": the engine thread on a, its helper on b, and the process's main
    thread (whose mask its later threads and children would inherit) as it was. The engine
    thread and its OpenMP helper carry the engine's name for the OS; the main thread not."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    status = Path("/proc/self/status").read_text()
    before = status.split("Cpus_allowed_list:")[1].split()[0]
    run = subprocess.run(
        [sys.executable, "-c", BOUND, str(model_dir("tiny-llama")), f"{a},{b}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["bound"] == [a, b]
    assert got["engine"] == str(a)
    assert str(b) in got["masks"]  # the OpenMP helper thread
    assert got["main"] == before
    assert got["engine_name"] == ENGINE_THREAD and got["main_name"] != ENGINE_THREAD
    assert got["names_on"][str(b)] == [ENGINE_THREAD]  # the helper took the name
