"""CPU by process per output token: what a served load costs beside the model itself, read
from /proc before and after a run (Linux; nothing where /proc is missing).

    engine       threads named rtp-engine (the engine thread and its OpenMP team,
                 rtp_serve/kernels/affinity.py) in any process counted
    fused, ...   each of a cluster's services (its info file's pids: nameservice, master,
                 cache, fused or prefill and decode workers, frontend, nats, redis) less its
                 engine threads: a worker's asyncio loop and gRPC threads
    launcher     `rtp-serve up`
    client       this process (the load client; for the in-process engine, less the engine)
    vllm         vLLM's server and every process under it (its engine core included)

Microseconds of CPU (user and system) per output token of the run. The sum of all but
`engine` over `engine` is the serving tax in CPU: on a machine whose cores the engine keeps
busy, every other process's microsecond is taken from the engine's threads, and while one
of them waits for its core the rest of the team waits for it at the next barrier.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from rtp_serve.kernels.affinity import ENGINE_THREAD

ENGINE = "engine"
Seconds = dict[str, float]  # group -> CPU seconds


def _ticks(stat: str) -> int:
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def _comm(stat: str) -> str:
    return stat[stat.index("(") + 1 : stat.rindex(")")]


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it (by parent pid, from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def of_cluster(pids: Sequence[dict]) -> dict[str, list[int]]:
    """A launched cluster's processes by service name, from its info file's `pids`."""
    out: dict[str, list[int]] = {}
    for p in pids:
        out.setdefault(p["name"], []).append(p["pid"])
    return out


def snapshot(processes: dict[str, list[int]], engine_apart: bool = True) -> Seconds:
    """CPU seconds so far per group: each named group's processes (their exited threads
    included), less their engine threads, which count as `engine` (with `engine_apart`;
    else each process whole)."""
    hz = os.sysconf("SC_CLK_TCK")
    out: Seconds = {}
    for name, pids in processes.items():
        for pid in pids:
            proc = Path(f"/proc/{pid}")
            try:
                total = _ticks((proc / "stat").read_text())
            except OSError:
                continue  # gone: what it used since the last snapshot is lost with it
            engine = 0
            try:
                tasks = list((proc / "task").iterdir()) if engine_apart else []
            except OSError:
                tasks = []
            for task in tasks:
                try:
                    stat = (task / "stat").read_text()
                except OSError:
                    continue  # a thread that ended: its time is in the process's
                if _comm(stat) == ENGINE_THREAD:
                    engine += _ticks(stat)
            out[name] = out.get(name, 0.0) + (total - engine) / hz
            if engine:
                out[ENGINE] = out.get(ENGINE, 0.0) + engine / hz
    return out


def per_token(before: Seconds, after: Seconds, output_tokens: int) -> dict[str, float]:
    """Microseconds per output token per group between the snapshots (engine first)."""
    if not output_tokens:
        return {}
    used = {g: after[g] - before.get(g, 0.0) for g in after}
    order = sorted(used, key=lambda g: (g != ENGINE, -used[g]))
    return {g: 1e6 * used[g] / output_tokens for g in order}


def describe(us: dict[str, float]) -> str:
    beside = {g: v for g, v in us.items() if g != ENGINE}
    tax = sum(beside.values())
    parts = ", ".join(f"{g} {v:,.0f}" for g, v in beside.items())
    if ENGINE not in us:
        return f"CPU per output token: {tax:,.0f} us ({parts})"
    engine = us[ENGINE]
    share = f" ({100 * tax / engine:.1f}% of the engine's)" if engine else ""
    return f"CPU per output token: engine {engine:,.0f} us; beside it {tax:,.0f}{share} = {parts}"
