"""A simulated step that takes its time on a core instead of sleeping through it.

Simulated workers on one machine with real services (`rtp-serve up --engine sim
--sim-step burn`) should slow each other and be slowed by the frontend, the master and
NATS as real workers are: a step of `s` seconds (the cost profile's, fitted on one free
core) spends `s` seconds of its thread's CPU time, and the OS shares the cores among all
who compute, so its wall time stretches under contention as a real step's does. Hashing
releases the GIL (as torch's operators do), so the worker's event loop runs meanwhile.
"""

from __future__ import annotations

import hashlib
import time

_CHUNK = bytes(1 << 16)  # ~50 us of BLAKE2b: hashlib releases the GIL above 2 KiB


def burn(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        hashlib.blake2b(_CHUNK)
