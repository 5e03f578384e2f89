"""How the folders map onto the one import package, `rtp_serve`, and the CPU kernels
(kernels/csrc) compiled into it when it is built or installed, one module per build in
rtp_serve/kernels/cpu_build.py; rtp_serve/kernels/cpu.py picks one by the CPU's flags.
An install compiles the host CPU's build only (RTP_SERVE_KERNEL_BUILDS=all: every build,
for a wheel or an image that other CPUs run); a worker on a CPU whose build is missing
compiles it on first use.

Everything else about the package is in pyproject.toml. The install never fails on the
kernels: without torch in the build environment, off x86-64, with RTP_SERVE_BUILD_KERNELS=0
or when the compiler is missing or fails, it installs without them (a warning here), and
the workers compile them on first use or use the torch reference ops.

The master's compiled table loops (services/master/csrc/block_table.cpp) are a plain
CPython extension: no torch, built wherever there is a C++ compiler (not with
RTP_SERVE_BUILD_KERNELS=0); without it the master runs the same table in numpy
(services/master/block_ids.py).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rtp_serve.kernels import cpu_build, isa  # noqa: E402

# The design's top-level folders stay where they are and map into the namespace; the
# packages without a folder of their own (core, models, the kernels' Python side) live
# under rtp_serve/. kernels/ holds only sources, so `import kernels` from the repository
# root still finds Hugging Face's package of that name.
PACKAGE_DIRS = {
    "rtp_serve": "rtp_serve",
    "rtp_serve.engine": "engine",
    "rtp_serve.services": "services",
    "rtp_serve.kernels.triton": "kernels/triton",
    "rtp_serve.kernels.csrc": "kernels/csrc",  # the C++ sources, for a compile on first use
}


def packages() -> list[str]:
    return [
        f"{package}.{sub}" if sub else package
        for package, folder in PACKAGE_DIRS.items()
        for sub in ["", *find_packages(folder)]
    ]


def _warn(why: str) -> None:
    sys.stderr.write(f"rtp-serve: CPU kernels not compiled at install ({why})\n")


class BuildNative(build_ext):
    """A failed compile leaves the numpy path; the install goes on."""

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            sys.stderr.write(f"rtp-serve: {ext.name} not compiled ({exc})\n")


MASTER_TABLE = Extension(
    "rtp_serve.services.master._block_table",
    ["services/master/csrc/block_table.cpp"],
    extra_compile_args=["-O3", "-std=c++17"],
    optional=True,
)


def native_modules() -> dict:
    master = [MASTER_TABLE] if os.environ.get("RTP_SERVE_BUILD_KERNELS", "1") != "0" else []
    kernels = kernel_modules()
    if not kernels:
        return {"ext_modules": master, "cmdclass": {"build_ext": BuildNative}}
    return {"ext_modules": master + kernels["ext_modules"], "cmdclass": kernels["cmdclass"]}


def kernel_modules() -> dict:
    if os.environ.get("RTP_SERVE_BUILD_KERNELS", "1") == "0":
        _warn("RTP_SERVE_BUILD_KERNELS=0")
        return {}
    if platform.machine() not in ("x86_64", "AMD64"):
        _warn(f"no builds for {platform.machine()}")
        return {}
    try:
        from torch.utils import cpp_extension
    except ImportError as exc:
        _warn(f"no torch to build against: {exc}")
        return {}

    class BuildKernels(cpp_extension.BuildExtension):
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

    host = isa.best_level(isa.cpu_flags())
    builds = cpu_build.builds_to_install(os.environ.get("RTP_SERVE_KERNEL_BUILDS", "host"), host)
    if not builds:
        _warn(f"no build for this CPU (ISA level {host})")
        return {}
    modules = cpu_build.extensions(builds, cpp_extension)
    return {"ext_modules": modules, "cmdclass": {"build_ext": BuildKernels}}


setup(
    packages=packages(),
    package_dir=PACKAGE_DIRS,
    package_data={"rtp_serve.kernels.csrc": ["*.cpp", "*.h"]},
    **native_modules(),
)
