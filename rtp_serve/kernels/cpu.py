"""The compiled CPU kernels (kernels/csrc) for the ISA level in use.

They are compiled when the project is installed (setup.py, one module per build in
rtp_serve/kernels/cpu_build.py), so a worker only imports them. Where the installed module is missing
(an install without a compiler, a source checkout never installed) or was built against
another torch, they are compiled on first use instead, by torch's extension builder (cached
under a name that carries the build and this checkout's path, so two checkouts sharing a
cache directory never load each other's build). If that fails too (no compiler), or the
level is `scalar` (RTP_SERVE_CPU_KERNELS=0 or RTP_SERVE_ISA=scalar), `load()` returns None
and the engine uses the torch reference ops. RTP_SERVE_ISA=avx2 on an AVX-512 machine loads
the AVX2 build, so each build can be tested where a better one would be chosen.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from rtp_serve.kernels import cpu_build

log = logging.getLogger(__name__)
_PACKAGED = Path(__file__).parent / "csrc"  # a wheel ships the sources in the package
_CSRC = (
    _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[2] / "kernels" / "csrc"
)


def load() -> ModuleType | None:
    """The compiled kernels, or None where the ISA level (as the environment caps it now)
    is `scalar` or they neither are installed nor build. A level capped below the CPU's
    caps torch's libraries too (isa.cap_libraries): call this before any torch op."""
    from rtp_serve.kernels.isa import cap_libraries, cpu_isa

    isa = cpu_isa()
    cap_libraries(isa)
    build = cpu_build.build_for(isa.level)
    return _load(build) if build else None


@functools.cache
def _load(build: str) -> ModuleType | None:
    # RTP_SERVE_CPU_KERNELS=jit: compile on first use even where installed (what a start
    # cost before they were; bench/load.py times both).
    if os.environ.get("RTP_SERVE_CPU_KERNELS") == "jit":
        return _build(build)
    return installed(build) or _build(build)


def installed(build: str) -> ModuleType | None:
    """The module setup.py compiled for `build`, if it is there and fits this torch."""
    import torch

    name = f"rtp_serve.kernels.{cpu_build.module_name(build)}"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # not built at install, or an ABI it cannot link against
        log.warning("CPU kernels %s not installed (%s); compiling them now", name, exc)
        return None
    ours = torch.__version__.split("+")[0]
    if module.torch_version != ours:
        log.warning(
            "CPU kernels %s were built against torch %s, this is %s; compiling them now",
            name,
            module.torch_version,
            ours,
        )
        return None
    log.info("CPU kernels: %s (%s build, installed)", module.__file__, build)
    return module


def check_installed() -> None:
    """Raise unless every build was compiled at install and this CPU's build loads: what an
    image that runs on any CPU ships (docker/Dockerfile.worker). The other builds are only
    looked for, never imported: a build above this CPU's level would die of SIGILL."""
    import importlib.util

    from rtp_serve.kernels.isa import best_level, cpu_flags

    missing = [
        build
        for build in cpu_build.BUILD_FLAGS
        if importlib.util.find_spec(f"rtp_serve.kernels.{cpu_build.module_name(build)}") is None
    ]
    if missing:
        raise RuntimeError(f"CPU kernel builds not installed: {missing}")
    build = cpu_build.build_for(best_level(cpu_flags()))
    if build and installed(build) is None:
        raise RuntimeError(f"the installed CPU kernel build {build} does not load")


def _build(build: str) -> ModuleType | None:
    where = hashlib.sha256(str(Path(__file__).resolve()).encode()).hexdigest()[:8]
    name = f"rtp_cpu_kernels_{build}_{where}"
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as compile_now

        with _exclusive(Path(_get_build_directory(name, verbose=False))):
            return compile_now(
                name=name,
                sources=[str(_CSRC / source) for source in cpu_build.SOURCES],
                extra_cflags=cpu_build.flags(build),
                extra_ldflags=list(cpu_build.LINK_FLAGS),
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
