"""Keep freed memory in the process instead of handing it back to the OS at once.

A worker moves a prompt's KV through fresh buffers of megabytes (split into blocks, a Put
request, its serialization; the cache service receives, copies and stores them), and glibc's
malloc gives blocks that large their own mapping, or trims the heap as soon as they are
freed: the next buffer is new memory, and each of its pages faults on first touch. On a
2-core VM that was most of the cost of writing one 270-token prompt back (18 MiB of
llama-100m KV: 50.7 ms of the serving loop, 14.7 ms with memory kept; `bench/writeback.py`).

`keep_freed_memory()` sets malloc's thresholds so that blocks up to 32 MiB come from the heap
and up to `trim_mib` of free heap stays mapped for reuse. What it keeps is bounded by
`trim_mib` per arena and is reused by the next allocation; `ps` shows it in RSS. A libc other
than glibc (musl) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above half its heap size, 32 MiB on 64-bit machines.
MMAP_THRESHOLD = 32 << 20
DEFAULT_TRIM_MIB = 256


def keep_freed_memory(trim_mib: int = DEFAULT_TRIM_MIB) -> bool:
    """Apply the thresholds; False where this libc has no mallopt or refused them."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, trim_mib << 20) == 1 and ok
    if not ok:
        log.warning("malloc refused the heap thresholds; freed buffers go back to the OS")
    return ok
