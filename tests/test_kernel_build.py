"""Building the CPU kernels survives a build that was killed: torch's builder leaves a
`lock` file it would wait on forever; ours removes it under an flock of its own."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import kernels.cpu as cpu
from kernels.isa import cpu_isa


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_one():
    isa = cpu_isa()
    if not isa.at_least("avx2"):
        pytest.skip("no compiled kernels on this CPU")
    from torch.utils.cpp_extension import _get_build_directory

    assert cpu.load() is not None  # built (or loaded) once, normally
    where = hashlib.sha256(str(Path(cpu.__file__).resolve()).encode()).hexdigest()[:8]
    build_dir = Path(_get_build_directory(f"rtp_cpu_kernels_{isa.hardware}_{where}", False))
    (build_dir / "lock").write_text("")  # what a build killed mid-way leaves behind
    assert cpu._build.__wrapped__(isa.hardware) is not None  # not waiting on it forever
    assert not (build_dir / "lock").exists()
