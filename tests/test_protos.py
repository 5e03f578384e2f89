"""The committed protobuf/gRPC stubs are exactly what scripts/gen_protos.py makes now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "services" / "common" / "pb"


def test_stubs_are_not_stale(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    fresh = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    committed = {p.name: p.read_bytes() for p in COMMITTED.iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed)
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"regenerate with `python scripts/gen_protos.py`: {stale}"
