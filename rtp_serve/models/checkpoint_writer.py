"""Write HuggingFace-format checkpoint files, deterministically and atomically.

Shared by the random-model builder (`make_model.py`) and the GGUF converter (`convert/`):
JSON with sorted keys, safetensors (sharded with HF's names when large) with sorted tensor
names and fixed metadata, and a directory that appears only when complete. Same inputs,
same bytes.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where weights are written (not to resolve a cached model)
    import torch

_META = {"format": "pt"}


def write_json(path: Path, obj: object) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


def save_weights(
    weights: Iterable[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int
) -> None:
    """Write model.safetensors, or HF-named shards plus model.safetensors.index.json.

    Tensors are consumed one by one and a shard is written as soon as it is full, so a
    converter holds at most one shard in memory. Shards are named once their count is known.
    """
    from safetensors.torch import save_file

    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = out / f".shard-{len(written) + 1:05d}.safetensors"
        save_file(dict(sorted(shard.items())), path, metadata=_META)
        written.append((path, list(shard)))
        shard.clear()

    for name, t in weights:  # greedy in model order, like HF's save_pretrained
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shard[name] = t
        size += nbytes
        total += nbytes
    flush()
    if len(written) == 1:
        written[0][0].replace(out / "model.safetensors")
        return
    weight_map = {}
    for k, (path, names) in enumerate(written, 1):
        fname = f"model-{k:05d}-of-{len(written):05d}.safetensors"
        path.replace(out / fname)
        weight_map |= dict.fromkeys(names, fname)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield a temp dir beside ``out``; on success it replaces ``out`` in one rename.

    A reader never sees a half-written checkpoint; on error the temp dir is removed.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only modes
            f.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists() and any(out.iterdir()):  # rename() only replaces an empty directory
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            out.replace(old)
            shutil.rmtree(old)
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
