"""The engine's threads: their name for the OS, and binding them to CPUs of their own
(`EngineConfig.thread_binding`).

Named: the engine thread calls itself `ENGINE_THREAD` before its first parallel region, and
the OpenMP team it then starts inherits the name, so `top -H`, `ps -L` and /proc tell the
model's threads from a worker's asyncio loop and gRPC threads (bench/cpu_use.py counts the
CPU each spends per output token).

The engine thread and its OpenMP helpers run the model's parallel regions. Left to the OS, a
thread moves between cores and leaves its caches behind; bound, thread i to CPU i, a lone
270-token prefill of llama-100m in the engine alone took 0.93-0.95x as long on 2 cores (an
AMD EPYC with AVX-512; decode steps, bound by memory, did not change), as vLLM's CPU
backend binds its threads. Served, with the frontend and the control plane on the same two
cores, it gained nothing (fused worker, concurrency 16: 230 and 236 output tokens/s bound,
235 and 232 not) and a lone stream decoded a little slower (14.8 against 14.3 ms a token):
a bound thread cannot leave the core another process wants. So binding is off unless asked.

  off    the default: the OS places the threads.
  auto   bind when this process may run on exactly as many CPUs as the engine has threads:
         a worker given exclusive cores (a cpuset of its own, Kubernetes' static CPU
         manager for a Guaranteed pod). Where it may run on more, binding would put every
         worker's thread 0 on the same core, so auto leaves them to the OS.
  a list "0-3" or "4,6": those CPUs, one per thread.

Only an engine on a thread of its own binds (`AsyncLLM`'s engine thread): a thread's mask
passes to the threads and processes it starts, which the caller's own thread must not
impose on them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ENGINE_THREAD = "rtp-engine"  # at most 15 bytes: the kernel's limit on a thread's name


def name_thread(name: str) -> None:
    """Names the calling thread for the OS (/proc/<pid>/task/<tid>/comm): the threads it
    starts from now on carry the name too. A no-op where /proc/thread-self is missing."""
    with contextlib.suppress(OSError):
        Path("/proc/thread-self/comm").write_text(name[:15])


MODES = ("auto", "off")


def parse_cpus(spec: str) -> list[int]:
    """ "0-3,6" -> [0, 1, 2, 3, 6]; ValueError for anything else."""
    cpus: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"thread_binding: {spec!r} is not auto, off or a CPU list like 0-3,6")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"thread_binding: {part.strip()!r} runs backwards")
        cpus.extend(range(lo, hi + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"thread_binding: {spec!r} names a CPU twice")
    return cpus


def check(spec: str) -> None:
    """ValueError unless `spec` is a mode or a CPU list."""
    if spec not in MODES:
        parse_cpus(spec)


def cpus_to_bind(spec: str, threads: int, allowed: set[int]) -> list[int] | None:
    """The CPUs for threads 0..threads-1, or None to leave them to the OS. ValueError for a
    list that does not give each thread one CPU this process may run on."""
    if spec == "off" or threads < 2:
        return None
    if spec == "auto":
        return sorted(allowed) if len(allowed) == threads else None
    cpus = parse_cpus(spec)
    if len(cpus) != threads:
        raise ValueError(f"thread_binding {spec!r} names {len(cpus)} CPUs for {threads} threads")
    if not set(cpus) <= allowed:
        raise ValueError(
            f"thread_binding {spec!r} names CPUs this process may not run on: "
            f"{sorted(set(cpus) - allowed)} (it may run on {sorted(allowed)})"
        )
    return cpus


def bind_threads(spec: str, threads: int, ops) -> list[int] | None:
    """On the engine's own thread, before it builds the model: binds its parallel team of
    `threads` as `spec` says through the compiled kernels `ops` (None: nothing to bind
    with); returns the CPUs bound, thread by thread, or None. No torch import here: the
    configuration checks `spec` in services that have none."""
    cpus = cpus_to_bind(spec, threads, os.sched_getaffinity(0))
    if cpus is None or ops is None:
        log.info("engine threads: %d, placed by the OS (thread_binding %s)", threads, spec)
        return None
    bound = list(ops.bind_threads(cpus))
    if -1 in bound:
        log.warning("engine threads: binding to CPUs %s refused for some: %s", cpus, bound)
    else:
        log.info("engine threads: %d, bound to CPUs %s", threads, bound)
    return bound
