"""Generate the Python protobuf/gRPC stubs of protos/*.proto into services/common/pb/.

    python scripts/gen_protos.py [--out DIR]

grpc_tools (pinned in constraints.txt) makes the output reproducible; tests/test_protos.py
regenerates into a temporary folder and fails if the committed stubs are stale. protoc writes
sibling imports as `import common_pb2`; they are rewritten to package imports here.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
DEFAULT_OUT = ROOT / "services" / "common" / "pb"
PACKAGE = "rtp_serve.services.common.pb"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    sources = sorted(p.name for p in PROTOS.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    modules = {p.removesuffix(".proto") + "_pb2" for p in sources}
    pattern = re.compile(rf"^import ({'|'.join(sorted(modules))}) as", re.MULTILINE)
    written = []
    for path in sorted(out.glob("*_pb2*.py*")):
        text = pattern.sub(rf"from {PACKAGE} import \1 as", path.read_text())
        # .pyi files import siblings without an alias.
        text = re.sub(
            rf"^import ({'|'.join(sorted(modules))})$",
            rf"from {PACKAGE} import \1",
            text,
            flags=re.MULTILINE,
        )
        path.write_text(text)
        written.append(path)
    (out / "__init__.py").write_text(
        '"""Generated protobuf and gRPC stubs (scripts/gen_protos.py); do not edit."""\n'
    )
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
