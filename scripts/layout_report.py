"""The layout in figures: lines of Python per folder, the largest files, the README's length,
and which engine modules the torch-free services import (the goal is none).

    python scripts/layout_report.py [ROOT]    # ROOT: a checkout (default: this one)

It reads the source only (no imports), so it runs on any checkout, old layouts included.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

SKIP = {".venv", ".git", "build", "pb", "__pycache__", ".models"}
TORCH_FREE = ("frontend", "master", "cache", "nameservice", "common")


def sources(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*.py")) if not SKIP & set(p.relative_to(root).parts)]


def engine_imports(path: Path) -> set[str]:
    """The engine modules a file imports, under either layout's name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found |= {
            n for n in names if n.split(".")[0] == "engine" or n.startswith("rtp_serve.engine")
        }
    return found


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent).resolve()
    files = sources(root)
    lines = {p: len(p.read_text().splitlines()) for p in files}
    per_folder: Counter[str] = Counter()
    for path, n in lines.items():
        parts = path.relative_to(root).parts
        per_folder[
            "/".join(parts[:2]) if parts[0] == "rtp_serve" and len(parts) > 2 else parts[0]
        ] += n
    print(f"{'folder':<22}{'lines':>8}")
    for folder, n in sorted(per_folder.items()):
        print(f"{folder:<22}{n:>8}")
    print("\nlargest files")
    for path, n in sorted(lines.items(), key=lambda kv: -kv[1])[:10]:
        print(f"{n:>6}  {path.relative_to(root)}")
    for service in TORCH_FREE:
        folder = root / "services" / service
        used = (
            set().union(*(engine_imports(p) for p in sources(folder))) if folder.is_dir() else set()
        )
        print(
            f"\nengine modules services/{service} imports: {len(used)}", *sorted(used), sep="\n  "
        )
    readme = root / "README.md"
    print(f"\nREADME.md: {len(readme.read_text().splitlines())} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
