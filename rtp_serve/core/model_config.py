"""What the model is, read from its config.json: the one reader every process shares."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> ModelConfig:
        path = Path(model_dir)
        cfg = json.loads((path / "config.json").read_text())
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported ({SUPPORTED_ARCHITECTURES})")
        window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
        # Sliding-window attention only differs past the window; refuse rather than be wrong.
        if window and window < cfg.get("max_position_embeddings", 0):
            raise ValueError("Mistral sliding_window attention is not supported")
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _rope(cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


def _rope(cfg: dict) -> tuple[float, RopeScaling]:
    """RoPE base and scaling from either layout of config.json.

    transformers 4.x writes `rope_theta` and `rope_scaling` (None, or a dict whose kind is
    `rope_type`, or `type` in older files); 5.x writes one `rope_parameters` dict holding
    `rope_theta` and the scaling fields, and no other rope keys. Where both appear the newer
    one wins, as in transformers.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    scaling = params if isinstance(params, dict) else cfg.get("rope_scaling") or {}
    theta = scaling.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = cfg.get("rope_theta")
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    partial = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported")
    return float(theta if theta is not None else 10000.0), RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )
