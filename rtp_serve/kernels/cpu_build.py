"""How the CPU kernels (kernels/csrc) are compiled: the sources, and one module per ISA build.

The same table serves the install (setup.py compiles every build into the package, so a
worker never waits on a compiler) and the fallback at run time (rtp_serve/kernels/cpu.py compiles
one build on first use when the installed module is missing or was built against another
torch). Each build names its instruction sets explicitly instead of -march=native, so a
wheel or an editable install made on one CPU works on any CPU that has them:

    build    compiled with                            used at ISA levels (rtp_serve/kernels/isa.py)
    avx2     AVX2, FMA, F16C                          avx2
    avx512   the above + AVX-512 F/BW/VL              avx512, avx512_bf16, amx

The bf16 and AMX levels add nothing to these sources: what they enable is oneDNN's
prepacked GEMMs inside torch (rtp_serve/kernels/linear.py), so they share the AVX-512 build.

Pure data and no torch import: setup.py reads it before torch is known to be there.
"""

from __future__ import annotations

SOURCES = (
    "module.cpp",
    "paged_decode.cpp",
    "small_gemm.cpp",
    "rows_gemm.cpp",
    "rms_norm.cpp",
    "kv_quant.cpp",
    "paged_prefill.cpp",
    "lora_rows.cpp",
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
