"""CPU kernels compiled from `kernels/csrc` on first use (cached by torch's extension builder).

They are built for the CPU they run on (-march=native), under a name that carries the ISA
level and this checkout's path, so two CPUs or two checkouts sharing a cache directory never
load each other's build. If no compiler is available, or the ISA level is `scalar`
(RTP_SERVE_CPU_KERNELS=0 or RTP_SERVE_ISA=scalar), `load()` returns None and the engine uses
the torch reference ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_decode.cpp",
        "small_gemm.cpp",
        "rows_gemm.cpp",
        "rms_norm.cpp",
        "kv_quant.cpp",
        "paged_prefill.cpp",
    )
]


def load() -> ModuleType | None:
    """The compiled kernels, or None where the ISA level (as the environment caps it now)
    is `scalar` or they do not build."""
    from kernels.isa import cpu_isa

    isa = cpu_isa()
    return _build(isa.hardware) if isa.at_least("avx2") else None


@functools.cache
def _build(hardware: str) -> ModuleType | None:
    where = hashlib.sha256(str(Path(__file__).resolve()).encode()).hexdigest()[:8]
    name = f"rtp_cpu_kernels_{hardware}_{where}"
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as build

        with _exclusive(Path(_get_build_directory(name, verbose=False))):
            return build(
                name=name,
                sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # no compiler, missing headers: the reference still works
        log.warning("CPU kernels unavailable, using the torch reference ops: %s", exc)
        return None


@contextlib.contextmanager
def _exclusive(build_dir: Path) -> Iterator[None]:
    """Build (or load) under an flock of our own. torch's builder marks a build in progress
    with a `lock` file that it waits on forever; a builder killed mid-build leaves it behind
    and every later worker would hang. The kernel drops an flock with its holder, so once we
    hold ours, a `lock` file there can only be such a leftover: it is removed."""
    with open(build_dir.parent / f"{build_dir.name}.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a kernel build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield
