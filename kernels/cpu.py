"""CPU kernels compiled from `kernels/csrc` on first use (cached by torch's extension builder).

If no compiler is available, or RTP_SERVE_CPU_KERNELS=0, `load()` returns None and the
engine falls back to the torch reference in `kernels.attention`.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
_SOURCES = [
    Path(__file__).parent / "csrc" / name for name in ("paged_decode.cpp", "small_gemm.cpp")
]


@functools.cache
def load() -> ModuleType | None:
    if os.environ.get("RTP_SERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name="rtp_cpu_kernels",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, missing headers: the reference still works
        log.warning("CPU attention kernels unavailable, using torch reference: %s", exc)
        return None
