"""Random PEFT LoRA adapters for any preset or checkpoint: the LoRA tests' fixtures.

`rtp-serve make-model --preset tiny-llama --lora-rank 8 --out DIR` writes `adapter_config.json`
and `adapter_model.safetensors` exactly as PEFT saves them. Unlike PEFT's init (B = 0, a
no-op), both matrices are random, sized so the update moves the outputs visibly: a test that
compares against the base model must see a difference.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from rtp_serve.core.peft_config import CONFIG_FILE, TARGETS, WEIGHTS_FILE
from rtp_serve.models.checkpoint_writer import atomic_dir, write_json

log = logging.getLogger(__name__)


def _base_config(base: str) -> dict:
    from rtp_serve.models.make_model import PRESETS, _config, get_preset, resolve_model

    if base in PRESETS:
        return _config(get_preset(base))
    return json.loads((Path(resolve_model(base)) / "config.json").read_text())


def build_adapter(
    base: str,
    out_dir: str | Path,
    rank: int,
    *,
    seed: int = 0,
    alpha: float | None = None,
    targets: tuple[str, ...] = TARGETS,
    gain: float = 0.5,
) -> Path:
    """Write a random adapter of `rank` for `base` (a preset name or a model directory)."""
    if rank <= 0:
        raise ValueError(f"lora rank must be positive, got {rank}")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"lora targets {unknown} are not among {list(TARGETS)}")
    cfg = _base_config(base)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads) * head_dim
    inter = cfg["intermediate_size"]
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_hidden_layers"]):
        for module in targets:
            parent = "self_attn" if module in TARGETS[:4] else "mlp"
            fan_in, fan_out = shapes[module]
            key = f"base_model.model.model.layers.{i}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=g) * gain / rank**0.5
            )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha if alpha is not None else rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        write_json(tmp / CONFIG_FILE, config)
        save_file(dict(sorted(tensors.items())), tmp / WEIGHTS_FILE, metadata={"format": "pt"})
    log.info("wrote a rank-%d LoRA adapter for %s into %s", rank, base, out)
    return out
