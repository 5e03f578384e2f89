"""Read a local HuggingFace checkpoint's safetensors (one file or an indexed set of shards)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_tensors(model_dir: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(model_dir):
        tensors.update(load_file(file, device=device))
    return tensors
