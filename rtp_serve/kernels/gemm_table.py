"""Which GEMM kernel serves a projection at each row count: measured on this machine, per
shape, when the model loads (not a fixed threshold), and cached on disk.

A CPU projection can run several ways (rtp_serve/kernels/linear.py): `rows_gemm` over the
checkpoint's [out, in] layout (each weight read once, dotted against a few rows: best while
a step is bound by streaming weights), `packed_gemm` over column panels (register-blocked
6 x 16 tiles: best once arithmetic counts), MKL's or oneDNN's GEMM (large prefill chunks,
and wider vectors on AVX-512 CPUs). Where one overtakes another moves with the CPU, the
shape and the thread count, so `tune()` times every path of each distinct shape at the row
counts in BUCKETS and gives the ops of that shape a `KernelTable`. The paths come in the
order of the rows they are built for (`Tunable.paths`), and a table keeps that order.

Small row counts are timed over as many of the model's own weights of that shape as make
STREAM_BYTES (more than a last-level cache), so they stream from memory as in a decode
step; larger ones over one weight, where arithmetic dominates. A table is cached under
$RTP_SERVE_CACHE/gemm (default ~/.cache/rtp-serve) by CPU, kernel build, threads and
shape: a restart reads it instead of measuring again. A shape measured while other
processes took more than `BUSY_SHARE` of this process's CPUs (a package install, a sibling
worker starting) is measured again, and a table still contended after `MEASURE_TRIES` is
used but not cached: a contended measurement favours whichever path ran while the others
paused (one measured while pip ran beside it picked MKL's single-threaded GEMV for every
decode step's QKV, at 2x the time of packed_gemm; another, as pip finished, kept
packed_gemm for q, k and v at every row count, where from 270 rows oneDNN is 3-9% faster),
and a cache would keep that choice for every later start. The share is taken per shape,
not over the whole tuning: a burst of a few hundred milliseconds skews the shape it falls
on and barely moves a 5-second average.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(__name__)

# 1024: a burst's prefill steps (2,048 rows; an MLP in slices of up to 1,024), where the
# path that wins at 256 rows can lose by a quarter (llama-100m's gate_up: packed_gemm
# 161 against oneDNN's 209 GFLOPS at 2,048 rows, 209 against 216 at 270).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
STREAM_BYTES = 48 << 20
STREAM_BELOW = 64  # from this many rows one weight is timed: the step is compute-bound
REPEATS = 3
ROUND_BUDGET_S = 0.1  # a round of a bucket longer than this is measured once, not REPEATS times
BUSY_SHARE = 0.10  # of this process's CPUs' time, taken by others: a measurement not trusted
MEASURE_TRIES = 2  # a shape measured while contended is measured again, this many times in all
# A step's rows are efficient from the first bucket whose projections cost at most this
# times their least time per row (efficient_rows).
EFFICIENT_WITHIN = 1.10


@dataclass(frozen=True, slots=True)
class KernelTable:
    """kernel[i] serves row counts in (upto[i-1], upto[i]]; the last serves every larger.
    A measured table also has `seconds[i]`: one op of its shape at upto[i] rows, on that
    bucket's kernel (the efficiency curve `efficient_rows` reads)."""

    upto: tuple[int, ...]
    kernel: tuple[str, ...]
    seconds: tuple[float, ...] = ()

    def pick(self, rows: int) -> str:
        return self.kernel[min(bisect.bisect_left(self.upto, rows), len(self.kernel) - 1)]

    @classmethod
    def split(cls, small: str, up_to: int, large: str) -> KernelTable:
        """`small` up to `up_to` rows, `large` beyond: the untuned default."""
        return cls((up_to, up_to + 1), (small, large))

    def compact(self) -> KernelTable:
        """Adjacent buckets with the same kernel merged (what the logs print)."""
        upto, kernel = [], []
        for u, k in zip(self.upto, self.kernel, strict=True):
            if kernel and kernel[-1] == k:
                upto[-1] = u
            else:
                upto.append(u)
                kernel.append(k)
        return KernelTable(tuple(upto), tuple(kernel))

    def describe(self) -> str:
        t = self.compact()
        lo = [1] + [u + 1 for u in t.upto[:-1]]
        return ", ".join(
            f"{a}-{b} {k}" if i < len(t.kernel) - 1 else f"{a}+ {k}"
            for i, (a, b, k) in enumerate(zip(lo, t.upto, t.kernel, strict=True))
        )


Path_ = Callable[[torch.Tensor], object]  # x -> the projection of x through one op


class Tunable(Protocol):
    nbytes: int

    def shape_key(self) -> str: ...  # what makes two ops interchangeable for timing
    def in_features(self) -> int: ...
    def act_dtype(self) -> torch.dtype: ...
    def paths(self) -> dict[str, Path_]: ...  # fewest rows first
    def use(self, table: KernelTable) -> None: ...


def tune(ops: Sequence[Tunable], cache: bool = True) -> dict[str, KernelTable]:
    """Measure (or read from the cache) a table per distinct shape and hand it to its ops."""
    groups: dict[str, list[Tunable]] = {}
    for op in ops:
        groups.setdefault(op.shape_key(), []).append(op)
    tables = {}
    start = time.perf_counter()
    others = OthersShare()
    measured = 0
    for key, members in groups.items():
        # The paths are in the key: a build that adds one measures again.
        file = _cache_file(f"{key} paths {','.join(members[0].paths())}") if cache else None
        table = _read(file)
        if (
            table is None
            or table.upto != BUCKETS
            or len(table.seconds) != len(BUCKETS)  # written before tables kept their times
            or set(table.kernel) - set(members[0].paths())
        ):
            table, busy = measure_quietly(members)
            measured += 1
            if busy <= BUSY_SHARE:
                _write(file, table)
            else:
                log.warning("GEMM table %s not cached: measured while other processes took "
                            "%.0f%% of this process's CPUs; measured again at the next start",
                            key, 100 * busy)  # fmt: skip
        for op in members:
            op.use(table)
        tables[key] = table
        log.info("GEMM table %s: %s", key, table.describe())
    if measured:
        log.info("GEMM tables: %d measured in %.2fs, other processes took %.0f%% of the CPUs",
                 measured, time.perf_counter() - start, 100 * others.share())  # fmt: skip
    return tables


def efficient_rows(tables: Iterable[KernelTable | None]) -> int | None:
    """The fewest rows (of BUCKETS) at which these projections together, a table per op,
    cost at most EFFICIENT_WITHIN times their least time per row: where a step's GEMMs
    reach the plateau of this machine's efficiency curve. None where a table is missing or
    was not measured (the fixed split, a GPU)."""
    tables = list(tables)
    if not tables or any(t is None or len(t.seconds) != len(BUCKETS) for t in tables):
        return None
    per_row = [sum(t.seconds[i] for t in tables) / rows for i, rows in enumerate(BUCKETS)]
    least = min(per_row)
    return next(
        rows for rows, c in zip(BUCKETS, per_row, strict=True) if c <= EFFICIENT_WITHIN * least
    )


def measure_quietly(members: Sequence[Tunable]) -> tuple[KernelTable, float]:
    """measure(), again where other processes took more than BUSY_SHARE of this process's
    CPUs meanwhile, MEASURE_TRIES times at most: the table of the least contended try, and
    the share the others took during it."""
    best: tuple[KernelTable, float] | None = None
    for _ in range(MEASURE_TRIES):
        others = OthersShare()
        table = measure(members)
        busy = others.share()
        if best is None or busy < best[1]:
            best = (table, busy)
        if busy <= BUSY_SHARE:
            break
    assert best is not None
    return best


class OthersShare:
    """The share of this process's CPUs (its affinity) that other processes, or the
    hypervisor (steal), took since construction, from /proc/stat less this process's own
    time; 0.0 where /proc cannot tell."""

    def __init__(self) -> None:
        self._cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        self._start = self._read()

    def _read(self) -> tuple[int, int, int] | None:
        """(all ticks, busy ticks of our CPUs, this process's ticks)."""
        try:
            total = busy = 0
            with open("/proc/stat") as f:
                for line in f:
                    name, *fields = line.split()
                    if name in self._cpus:
                        ticks = [int(v) for v in fields]
                        total += sum(ticks[:8])  # user..steal; guest time is inside user
                        busy += sum(ticks[:8]) - ticks[3] - ticks[4]  # less idle, iowait
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
            return total, busy, int(own[11]) + int(own[12])  # utime, stime
        except (OSError, ValueError, IndexError):
            return None

    def share(self) -> float:
        end = self._read()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return 0.0
        total, busy, own = (b - a for a, b in zip(self._start, end, strict=True))
        return max(0.0, busy - own) / total


def measure(members: Sequence[Tunable]) -> KernelTable:
    """Time every path of `members` (ops of one shape) at each of BUCKETS rows, and fit the
    table: the paths in their order (fewest rows first), each serving one contiguous run of
    buckets (possibly none), with the least total time relative to each bucket's best.
    Where two paths are within noise of each other, measured one bucket at a time the
    winner flips back and forth; the fit keeps the order and takes the switch points that
    cost the least."""
    first = members[0]
    names = list(first.paths())
    streamed = members[: max(1, min(len(members), math.ceil(STREAM_BYTES / first.nbytes)))]
    g = torch.Generator().manual_seed(0)
    rel: list[list[float]] = []  # [bucket][path]: time / the bucket's best time
    per_op: list[list[float]] = []  # [bucket][path]: seconds for one op
    for rows in BUCKETS:
        use = streamed if rows < STREAM_BELOW else members[:1]
        x = torch.randn(rows, first.in_features(), generator=g).to(first.act_dtype())
        runs = [[op.paths()[name] for op in use] for name in names]
        # The first round warms caches, allocators and oneDNN's kernel for this shape (made
        # on its first call); a round over budget (large GEMMs) is measured once more.
        rounds = [_round(runs, x)]
        repeats = REPEATS if sum(rounds[0]) < ROUND_BUDGET_S else 1
        rounds = [_round(runs, x) for _ in range(repeats)]
        best = [min(r[i] for r in rounds) for i in range(len(names))]
        rel.append([b / min(best) for b in best])
        per_op.append([b / len(use) for b in best])
    kernel = fit_runs(rel, names)
    seconds = tuple(per_op[i][names.index(k)] for i, k in enumerate(kernel))
    return KernelTable(BUCKETS, kernel, seconds)


def _round(runs: list[list[Path_]], x: torch.Tensor) -> list[float]:
    """Seconds of each path over its ops, the paths in turn (so a busy spell of a shared
    machine falls on all of them)."""
    times = []
    for fns in runs:
        t0 = time.perf_counter()
        for fn in fns:
            fn(x)
        times.append(time.perf_counter() - t0)
    return times


def fit_runs(rel: list[list[float]], names: list[str]) -> tuple[str, ...]:
    """The path per bucket: non-decreasing path index (each path one contiguous run of
    buckets) with the least total of rel[bucket][path]. Dynamic programming over
    (bucket, path): O(buckets x paths^2)."""
    n, k = len(rel), len(names)
    cost = [[math.inf] * k for _ in range(n)]
    back = [[0] * k for _ in range(n)]
    for p in range(k):
        cost[0][p] = rel[0][p]
    for b in range(1, n):
        for p in range(k):
            prev = min(range(p + 1), key=lambda q: cost[b - 1][q])
            cost[b][p] = cost[b - 1][prev] + rel[b][p]
            back[b][p] = prev
    p = min(range(k), key=lambda q: cost[n - 1][q])
    chosen = [p]
    for b in range(n - 1, 0, -1):
        p = back[b][p]
        chosen.append(p)
    return tuple(names[p] for p in reversed(chosen))


def cache_dir() -> Path:
    return Path(os.environ.get("RTP_SERVE_CACHE", Path.home() / ".cache" / "rtp-serve")) / "gemm"


def _cache_file(key: str) -> Path:
    ident = f"{_machine()}|threads={torch.get_num_threads()}|{key}"
    return cache_dir() / f"{hashlib.sha256(ident.encode()).hexdigest()[:20]}.json"


@functools.cache
def _machine() -> str:
    """The CPU and the kernel build: a table is only valid where both are the same."""
    from rtp_serve.kernels import cpu
    from rtp_serve.kernels.isa import cpu_isa

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    ops = cpu.load()
    build = ""
    if ops is not None and getattr(ops, "__file__", None):
        build = hashlib.sha256(Path(ops.__file__).read_bytes()).hexdigest()[:16]
    return f"{model}|{cpu_isa().describe()}|{build}|torch {torch.__version__}"


def _read(file: Path | None) -> KernelTable | None:
    if file is None or not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
        return KernelTable(
            tuple(data["upto"]), tuple(data["kernel"]), tuple(data.get("seconds", ()))
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring GEMM table cache %s: %s", file, exc)
        return None


def _write(file: Path | None, table: KernelTable) -> None:
    if file is None:
        return
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(
            json.dumps({"upto": table.upto, "kernel": table.kernel, "seconds": table.seconds})
        )
        tmp.replace(file)  # atomic: a concurrent reader sees the old file or the new
    except OSError as exc:  # a read-only home: measured again next start
        log.warning("GEMM table not cached (%s)", exc)
