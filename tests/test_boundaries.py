"""The layering rules, checked on the source and on a real import:

rtp_serve.core      imports nothing of ours and never torch: the contract every process shares
rtp_serve.kernels   the ops; never the engine or the services
rtp_serve.engine    the workers' torch engine; never the services
services            the frontend, master, cache service, nameservice and services/common
                    import only core and services (no engine, no kernels, no torch);
                    workers reach the engine only through AsyncLLM
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The services that run without torch, and the shared code they import.
TORCH_FREE_SERVICES = ("frontend", "master", "cache", "nameservice", "planner", "common")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _sources(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.rglob("*.py")) if "pb" not in p.relative_to(ROOT).parts]


def _module(path: Path) -> str:
    """The import name of a source file, as setup.py maps its folder."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] != "rtp_serve":
        parts = ("rtp_serve", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _offending(folders: list[Path], banned: tuple[str, ...]) -> list[str]:
    bad = []
    for folder in folders:
        for path in _sources(folder):
            hits = sorted(
                m for m in _imports(path) if m.split(".")[0] in banned or m.startswith(banned)
            )
            bad += [f"{path.relative_to(ROOT)} imports {m}" for m in hits]
    return bad


def test_core_imports_nothing_of_ours_and_never_torch() -> None:
    banned = (
        "torch",
        "rtp_serve.engine",
        "rtp_serve.kernels",
        "rtp_serve.services",
        "rtp_serve.models",
    )
    assert _offending([ROOT / "rtp_serve" / "core"], banned) == []


def test_engine_and_kernels_never_import_services() -> None:
    folders = [
        ROOT / "engine",
        ROOT / "rtp_serve" / "kernels",
        ROOT / "rtp_serve" / "models",
        ROOT / "kernels",
    ]
    assert _offending(folders, ("rtp_serve.services",)) == []


def test_torch_free_services_import_only_core_and_services() -> None:
    folders = [ROOT / "services" / name for name in TORCH_FREE_SERVICES]
    banned = ("torch", "rtp_serve.engine", "rtp_serve.kernels")
    assert _offending(folders, banned) == []


def test_torch_free_services_load_without_torch() -> None:
    """Every module of the torch-free services and of core, imported in one fresh process,
    leaves torch unloaded (the static check above misses an import through a third party)."""
    folders = [ROOT / "rtp_serve" / "core", *(ROOT / "services" / n for n in TORCH_FREE_SERVICES)]
    modules = [_module(p) for folder in folders for p in _sources(folder)]
    code = (
        f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('rtp_serve.engine'))\n"
        "assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("folder", ["rtp_serve", "engine", "services", "kernels"])
def test_every_module_has_one_import_name(folder: str) -> None:
    """No source file imports another of ours by a top-level name other than rtp_serve."""
    ours = ("engine", "services", "kernels", "core", "models")
    bad = [
        f"{path.relative_to(ROOT)} imports {m}"
        for path in _sources(ROOT / folder)
        for m in sorted(_imports(path))
        if m.split(".")[0] in ours
    ]
    assert bad == []


def test_services_reach_the_engine_only_through_its_interface() -> None:
    internals = re.compile(
        r"\bllm\.engine\b|(?<!rtp_serve)\.engine\.(pool|scheduler|runner|config|kv)\b"
    )
    for path in _sources(ROOT / "services"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not internals.search(line), f"{path.relative_to(ROOT)}:{n}: {line.strip()}"


def test_the_simulated_worker_loads_without_torch() -> None:
    """`rtp-serve sim-worker` runs the workers' serving code over the simulated engine: a
    thousand of them in one process must not load torch (nor the torch engine)."""
    modules = [_module(p) for p in _sources(ROOT / "services" / "sim")]
    modules += [_module(p) for p in _sources(ROOT / "engine" / "sim")]
    code = (
        f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')"
        " or m in ('rtp_serve.engine.async_llm', 'rtp_serve.engine.llm_engine'))\n"
        "assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
