"""How the CPU kernels (kernels/csrc) are compiled: the sources, and one module per ISA build.

The same table serves the install (setup.py compiles builds into the package, so a worker
never waits on a compiler) and the fallback at run time (rtp_serve/kernels/cpu.py compiles
one build on first use when the installed module is missing or was built against another
torch). Which builds the install compiles is RTP_SERVE_KERNEL_BUILDS (`builds_to_install`):
by default only the host CPU's (an editable install on a developer's machine), `all` for a
wheel or an image that other CPUs will run. Each build names its instruction sets explicitly instead of -march=native, so a
wheel or an editable install made on one CPU works on any CPU that has them:

    build    compiled with                            used at ISA levels (rtp_serve/kernels/isa.py)
    avx2     AVX2, FMA, F16C                          avx2
    avx512   the above + AVX-512 F/BW/VL              avx512, avx512_bf16, amx

The bf16 and AMX levels add nothing to these sources: what they enable is oneDNN's
prepacked GEMMs inside torch (rtp_serve/kernels/linear.py), so they share the AVX-512 build.

Pure data and no torch import: setup.py reads it before torch is known to be there.
"""

from __future__ import annotations

from typing import Any

SOURCES = (
    "module.cpp",
    "paged_decode.cpp",
    "small_gemm.cpp",
    "rows_gemm.cpp",
    "packed_gemm.cpp",
    "fma_peak.cpp",
    "rms_norm.cpp",
    "kv_quant.cpp",
    "kv_write.cpp",
    "paged_prefill.cpp",
    "lora_rows.cpp",
    "int8_gemm.cpp",
    "rope.cpp",
    "silu_mul.cpp",
    "thread_affinity.cpp",
)
COMMON_FLAGS = ("-O3", "-g0", "-ffast-math", "-fopenmp")  # -g0: Python's CFLAGS carry -g
LINK_FLAGS = ("-fopenmp",)
BUILD_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"),
}
_BUILD_OF_LEVEL = {"avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": "avx512"}


def build_for(level: str) -> str | None:
    """The build that runs at this ISA level, or None (scalar: the torch reference)."""
    return _BUILD_OF_LEVEL.get(level)


def module_name(build: str) -> str:
    """The installed module of a build, inside the `rtp_serve.kernels` package."""
    return f"_cpu_{build}"


def flags(build: str) -> list[str]:
    return [*COMMON_FLAGS, *BUILD_FLAGS[build]]


def builds_to_install(spec: str, host_level: str) -> list[str]:
    """The builds an install compiles, from RTP_SERVE_KERNEL_BUILDS: `host` (the build of the
    CPU running the install, none on one without AVX2), `all`, or names ("avx2,avx512")."""
    spec = spec.strip().lower() or "host"
    if spec == "host":
        build = build_for(host_level)
        return [build] if build else []
    if spec == "all":
        return list(BUILD_FLAGS)
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in BUILD_FLAGS]
    if unknown:
        raise ValueError(
            f"RTP_SERVE_KERNEL_BUILDS: unknown build(s) {unknown}; "
            f"use host, all or some of {list(BUILD_FLAGS)}"
        )
    return names


def extensions(builds: list[str], cpp_extension: Any) -> list[Any]:
    """The setuptools extension of each build, sources relative to the repository root.
    `cpp_extension` is torch.utils.cpp_extension, passed in so this module stays torch-free:
    setup.py (an install) and docker/compile_kernels.py (the worker image) build these."""
    return [
        cpp_extension.CppExtension(
            f"rtp_serve.kernels.{module_name(build)}",
            sources=[f"kernels/csrc/{source}" for source in SOURCES],
            extra_compile_args=flags(build),
            extra_link_args=list(LINK_FLAGS),
        )
        for build in builds
    ]
