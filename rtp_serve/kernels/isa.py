"""What this CPU can do, read once at start, and the kernel paths that follow from it.

Machines of one kind are not all the same CPU: some stop at AVX2, others have AVX-512 with
bf16 dot products, VNNI and AMX tiles. The engine picks its kernels from `cpu_isa()`:

    level        needs (Linux /proc/cpuinfo flags)        what it enables
    amx          amx_bf16 amx_int8 avx512_bf16            oneDNN prepacked bf16 GEMMs (AMX tiles)
    avx512_bf16  avx512_bf16 avx512f                      oneDNN prepacked bf16 GEMMs
    avx512       avx512f avx512bw avx512vl (+ avx2's)     compiled kernels built for AVX-512
    avx2         avx2 fma f16c                            compiled kernels built for AVX2
    scalar       -                                        torch reference ops only

`RTP_SERVE_ISA=<level>` caps the level below what the CPU has, so every fallback can be
forced and tested on a machine that has more (it never raises it above the hardware). A
capped level caps torch's own libraries too (`cap_libraries`: ATen's vectorized ops, oneDNN,
MKL), so that the process runs what a machine of that level would, GEMMs included.
The compiled kernels are built at install time for each level's instruction sets
(rtp_serve/kernels/cpu_build.py) and the module of the level in use is loaded; `RTP_SERVE_CPU_KERNELS=0`
(or level `scalar`) turns them off.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass

log = logging.getLogger(__name__)

LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
# Each level needs the one below it too: its kernels are built with both's instructions.
_AVX2 = {"avx2", "fma", "f16c"}
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl"}
_NEEDS = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": _AVX512 | {"avx512_bf16"},
    "amx": _AVX512 | {"avx512_bf16", "amx_bf16", "amx_int8"},
}
# Reported in logs and Stats (the VNNI and AMX-INT8 ones gate no path yet).
_REPORTED = (
    "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
    "amx_bf16", "amx_int8", "amx_tile",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class CpuIsa:
    hardware: str  # the best level the CPU has
    level: str  # the level in use (hardware, or lower if capped by RTP_SERVE_ISA)
    flags: tuple[str, ...]  # the reported flags the CPU has

    def at_least(self, level: str) -> bool:
        return LEVELS.index(self.level) >= LEVELS.index(level)

    def describe(self) -> str:
        capped = f" (capped from {self.hardware})" if self.level != self.hardware else ""
        return f"{self.level}{capped}; flags {' '.join(self.flags) or 'none'}"


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()  # not Linux, or no /proc: assume nothing beyond what torch does


# The flags a benchmark prints beside its numbers, so figures from different CPUs are never
# compared unknowingly.
BENCH_FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512f", "avx2")


def bench_flags() -> str:
    """The BENCH_FLAGS this CPU has, as `grep -o -w -E 'amx_bf16|...' /proc/cpuinfo | sort -u`
    prints them."""
    return " ".join(sorted(set(BENCH_FLAGS) & cpu_flags())) or f"none of {'/'.join(BENCH_FLAGS)}"


def best_level(flags: frozenset[str]) -> str:
    if platform.machine() not in ("x86_64", "AMD64"):
        return "scalar"
    best = "scalar"
    for level in LEVELS[1:]:
        if _NEEDS[level] <= flags:
            best = level
    return best


def resolve(flags: frozenset[str], cap: str | None) -> CpuIsa:
    hardware = best_level(flags)
    level = hardware
    if cap:
        if cap not in LEVELS:
            raise ValueError(f"RTP_SERVE_ISA={cap!r}: expected one of {', '.join(LEVELS)}")
        if LEVELS.index(cap) < LEVELS.index(hardware):
            level = cap
    if os.environ.get("RTP_SERVE_CPU_KERNELS", "1") == "0":
        level = "scalar"
    return CpuIsa(hardware, level, tuple(f for f in _REPORTED if f in flags))


def cpu_isa() -> CpuIsa:
    """This CPU's level, capped by the environment as it is now (so a test can force one)."""
    return resolve(cpu_flags(), os.environ.get("RTP_SERVE_ISA") or None)


# What a level caps torch's libraries at: the variables each reads, once, at its first use in
# a process. amx and scalar cap nothing (scalar is "no compiled kernels", not a CPU).
_LIBRARY_CAPS = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}


def library_caps(isa: CpuIsa) -> dict[str, str]:
    """The environment that stops torch's libraries at `isa.level`, where that level is
    capped below the hardware's (empty where it is not)."""
    if isa.level == isa.hardware:
        return {}
    return dict(_LIBRARY_CAPS.get(isa.level, {}))


def cap_libraries(isa: CpuIsa) -> dict[str, str]:
    """Caps torch's libraries at a level forced below the hardware's (`library_caps`), by
    setting their variables where the environment does not set them already; returns what
    this process's environment now says for them. Call it before the process's first torch
    op: ATen fixes its capability at its first vectorized op (then this warns, once, and
    ATen's ops run at the hardware's level)."""
    for name, value in library_caps(isa).items():
        os.environ.setdefault(name, value)
    now = {name: os.environ[name] for name in library_caps(isa)}
    if now:
        _announce(tuple(sorted(now.items())))
    return now


@functools.cache
def _announce(caps: tuple[tuple[str, str], ...]) -> None:
    import torch

    log.info("torch's libraries capped too: %s", " ".join(f"{k}={v}" for k, v in caps))
    wanted = dict(caps).get("ATEN_CPU_CAPABILITY")
    got = torch.backends.cpu.get_cpu_capability()
    if wanted and got.lower() != wanted.lower():
        log.warning(
            "torch's vectorized ops stay at %s, not %s: torch ran before the cap was set "
            "(start the process with ATEN_CPU_CAPABILITY=%s to cap them)",
            got,
            wanted,
            wanted,
        )
