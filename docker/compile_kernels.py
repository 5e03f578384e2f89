"""Compiles every build of the CPU kernels (rtp_serve/kernels/cpu_build.py) into OUT, for the
worker image (docker/Dockerfile.worker, its `kernels` stage), and fails if one does not
compile: unlike an install (setup.py), an image must not ship without them.

    python docker/compile_kernels.py OUT      # from a tree holding rtp_serve/kernels and kernels/csrc

It needs only the kernels' sources and their build table, so the image layer it makes
depends on nothing else: an edit anywhere else reuses it.
"""

from __future__ import annotations

import sys

from setuptools import setup
from torch.utils import cpp_extension

from rtp_serve.kernels import cpu_build

if __name__ == "__main__":
    setup(
        name="rtp-serve-kernels",
        ext_modules=cpu_build.extensions(list(cpu_build.BUILD_FLAGS), cpp_extension),
        cmdclass={"build_ext": cpp_extension.BuildExtension},
        script_args=["-q", "build_ext", "--build-lib", sys.argv[1]],
    )
