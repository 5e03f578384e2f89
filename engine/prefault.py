"""Mapping a large CPU KV pool's pages ahead of use, in the background, when a core is idle.

The pool is a fresh anonymous mapping (`model_runner._kv_pool`), so that a worker starts at
once: the kernel maps each 4 KiB page on its first write, and the first request through
each block pays for its pages. A thread at the lowest priority (nice 19: it runs when a core
would otherwise idle) asks the kernel to map the pool, 64 MiB at a time, in the order the
block pool hands out never-used blocks (lowest first), with madvise(MADV_POPULATE_WRITE):
each page is mapped as a write would map it, and nothing is written, so blocks already in
use keep their contents. A kernel older than Linux 5.14 refuses the call, and the pool is
then faulted in by its requests as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
STEP_BYTES = 64 << 20


def stretches(pool: torch.Tensor) -> Iterator[list[tuple[int, int]]]:
    """The pool [layers, 2, slots, ...] as rounds of (address, bytes) stretches: each round
    the next slots of every layer's K and V, about STEP_BYTES in all."""
    segments = pool.shape[0] * pool.shape[1]
    slots = pool.shape[2]
    row = pool[0, 0, 0].nbytes
    per_round = max(1, STEP_BYTES // (segments * row))
    base = pool.data_ptr()
    for s0 in range(0, slots, per_round):
        s1 = min(slots, s0 + per_round)
        yield [(base + (seg * slots + s0) * row, (s1 - s0) * row) for seg in range(segments)]


def fault_in(pool: torch.Tensor, stop: threading.Event | None = None) -> int:
    """Map the pool's pages (the pages wholly inside each stretch); returns the bytes asked
    for, or stops early with what it had where the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    done = 0
    for round_ in stretches(pool):
        if stop is not None and stop.is_set():
            break
        for address, nbytes in round_:
            first = -(-address // page) * page
            end = (address + nbytes) // page * page
            if end <= first:
                continue
            if libc.madvise(first, end - first, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                log.info("KV pool not mapped ahead: madvise refused (%s)", os.strerror(err))
                return done
            done += end - first
    return done


def start(pool: torch.Tensor) -> threading.Event:
    """Map `pool` from a background thread at nice 19; set the returned event to stop it."""
    stop = threading.Event()

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only
        started = time.perf_counter()
        done = fault_in(pool, stop)
        log.info(
            "KV pool mapped ahead: %.1f GiB in %.1f s", done / 2**30, time.perf_counter() - started
        )

    threading.Thread(target=run, name="kv-prefault", daemon=True).start()
    return stop
