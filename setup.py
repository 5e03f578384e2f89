"""Compiles the CPU kernels (kernels/csrc) into the package when it is built or installed,
one module per build in kernels/cpu_build.py; kernels/cpu.py picks one by the CPU's flags.

Everything else about the package is in pyproject.toml. The install never fails on the
kernels: without torch in the build environment, off x86-64, with RTP_SERVE_BUILD_KERNELS=0
or when the compiler is missing or fails, it installs without them (a warning here), and
the workers compile them on first use or use the torch reference ops.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import cpu_build  # noqa: E402


def _warn(why: str) -> None:
    sys.stderr.write(f"rtp-serve: CPU kernels not compiled at install ({why})\n")


def kernel_modules() -> dict:
    if os.environ.get("RTP_SERVE_BUILD_KERNELS", "1") == "0":
        _warn("RTP_SERVE_BUILD_KERNELS=0")
        return {}
    if platform.machine() not in ("x86_64", "AMD64"):
        _warn(f"no builds for {platform.machine()}")
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        _warn(f"no torch to build against: {exc}")
        return {}

    class BuildKernels(BuildExtension):
        def build_extensions(self) -> None:
            try:
                super().build_extensions()
            except Exception as exc:  # no compiler to check the ABI of, for one
                _warn(str(exc))

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception as exc:  # no compiler, or it fails: the package still installs
                _warn(f"{ext.name}: {exc}")

    modules = [
        CppExtension(
            f"kernels.{cpu_build.module_name(build)}",
            sources=[f"kernels/csrc/{source}" for source in cpu_build.SOURCES],
            extra_compile_args=cpu_build.flags(build),
            extra_link_args=list(cpu_build.LINK_FLAGS),
        )
        for build in cpu_build.BUILD_FLAGS
    ]
    return {"ext_modules": modules, "cmdclass": {"build_ext": BuildKernels}}


setup(**kernel_modules())
