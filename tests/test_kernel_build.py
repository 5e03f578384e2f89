"""The CPU kernels: the module compiled at install is the one a worker loads (no compiler
runs at start-up); where it is missing or was built against another torch, they are
compiled on first use; forced off, the engine gets None (the torch reference ops). And a
compile on first use survives a build that was killed: torch's builder leaves a `lock` file
it would wait on forever; ours removes it under an flock of its own."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rtp_serve.kernels.cpu as cpu
from rtp_serve.kernels import cpu_build
from rtp_serve.kernels.isa import cpu_isa

ROOT = Path(__file__).resolve().parents[1]
BUILD = cpu_build.build_for(cpu_isa().level)
needs_kernels = pytest.mark.skipif(BUILD is None, reason="no compiled kernels on this CPU")

_LOAD = """
import json
from rtp_serve.kernels import cpu
ops = cpu.load()
print(json.dumps(None if ops is None else {"name": ops.__name__, "file": ops.__file__}))
"""


def _load_in_a_fresh_process(tmp_path: Path, **env: str) -> tuple[dict | None, list[Path]]:
    """What cpu.load() returns in a new process, and what torch's JIT builder wrote."""
    cache = tmp_path / "torch_extensions"
    environ = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), **env}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD], env=environ, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    built = sorted(cache.rglob("*")) if cache.exists() else []
    return json.loads(out.stdout.strip().splitlines()[-1]), built


@needs_kernels
@pytest.mark.skipif(shutil.which("c++") is None, reason="installed without a compiler")
def test_the_module_built_at_install_is_loaded_and_nothing_is_compiled(tmp_path):
    got, built = _load_in_a_fresh_process(tmp_path)
    assert got is not None
    assert got["name"] == f"rtp_serve.kernels.{cpu_build.module_name(BUILD)}"
    assert Path(got["file"]).parent == Path(cpu.__file__).parent  # inside the package
    assert built == []  # torch's builder never ran


@needs_kernels
def test_forced_off_is_the_torch_reference(tmp_path):
    for env in ({"RTP_SERVE_CPU_KERNELS": "0"}, {"RTP_SERVE_ISA": "scalar"}):
        got, built = _load_in_a_fresh_process(tmp_path, **env)
        assert got is None and built == [], env


def test_every_level_above_scalar_has_a_build_with_flags():
    from rtp_serve.kernels.isa import LEVELS

    for level in LEVELS:
        build = cpu_build.build_for(level)
        assert (build is None) == (level == "scalar")
        if build:
            assert "-march=native" not in cpu_build.flags(build)
            assert set(cpu_build.BUILD_FLAGS["avx2"]) <= set(cpu_build.flags(build))


@needs_kernels
def test_an_installed_module_built_against_another_torch_is_not_loaded(monkeypatch):
    name = f"rtp_serve.kernels.{cpu_build.module_name(BUILD)}"
    try:
        module = importlib.import_module(name)
    except ImportError:
        pytest.skip("not built at install")
    assert cpu.installed(BUILD) is module
    monkeypatch.setattr(module, "torch_version", "0.0.0")
    assert cpu.installed(BUILD) is None


@needs_kernels
def test_a_missing_installed_module_is_compiled_on_first_use(monkeypatch):
    monkeypatch.setattr(cpu_build, "module_name", lambda build: f"_cpu_{build}_missing")
    assert cpu.installed(BUILD) is None
    ops = cpu._load.__wrapped__(BUILD)
    assert ops is not None and ops.__name__.startswith(f"rtp_cpu_kernels_{BUILD}_")
    import torch

    assert ops.torch_version == torch.__version__.split("+")[0]


@needs_kernels
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_one():
    from torch.utils.cpp_extension import _get_build_directory

    assert cpu._build(BUILD) is not None  # built (or loaded) once, normally
    where = hashlib.sha256(str(Path(cpu.__file__).resolve()).encode()).hexdigest()[:8]
    build_dir = Path(_get_build_directory(f"rtp_cpu_kernels_{BUILD}_{where}", False))
    (build_dir / "lock").write_text("")  # what a build killed mid-way leaves behind
    assert cpu._build(BUILD) is not None  # not waiting on it forever
    assert not (build_dir / "lock").exists()


def test_an_install_compiles_the_hosts_build_unless_told_otherwise():
    assert cpu_build.builds_to_install("", "avx2") == ["avx2"]
    assert cpu_build.builds_to_install("host", "amx") == ["avx512"]
    assert cpu_build.builds_to_install("host", "scalar") == []
    assert cpu_build.builds_to_install("all", "scalar") == list(cpu_build.BUILD_FLAGS)
    assert cpu_build.builds_to_install(" avx512 , avx2", "avx2") == ["avx512", "avx2"]
    with pytest.raises(ValueError, match="sse4"):
        cpu_build.builds_to_install("avx2,sse4", "avx2")


def test_the_image_check_names_a_build_missing_from_the_install(monkeypatch):
    real = cpu_build.module_name
    monkeypatch.setattr(cpu_build, "module_name", lambda b: real(b) + ("_gone" * (b == "avx2")))
    # (an install compiles only the host's build, so others may be missing too)
    with pytest.raises(RuntimeError, match=r"not installed: \[[^]]*'avx2'"):
        cpu.check_installed()
