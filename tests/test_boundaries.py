"""The layering rules, checked on the source: the engine never imports the services, and no
service reaches past AsyncLLM into the engine's internals."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_engine_and_kernels_never_import_services() -> None:
    for folder in ("engine", "rtp_serve", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            bad = {m for m in _imports(path) if m.startswith("rtp_serve.services")}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_services_reach_the_engine_only_through_its_interface() -> None:
    internals = re.compile(r"\bllm\.engine\b|(?<!rtp_serve)\.engine\.(pool|scheduler|runner|config|kv)\b")
    for path in (ROOT / "services").rglob("*.py"):
        if "pb" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not internals.search(line), f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
