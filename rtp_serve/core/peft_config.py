"""A PEFT LoRA adapter directory, read and checked (torch-free: the frontend reads it too).

PEFT writes `adapter_config.json` (r, lora_alpha, target_modules, ...) beside
`adapter_model.safetensors`. What this engine applies is the plain LoRA update of a linear
layer, `y = x W^T + scaling * (x A^T) B^T`, on the attention and MLP projections; anything
else an adapter may ask for (DoRA, biases, other modules, per-layer ranks) is refused by
the name of its field rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from rtp_serve.core.block_hash import adapter_fingerprint

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by their HF module names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {t: "self_attn" if t in TARGETS[:4] else "mlp" for t in TARGETS}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the file or field."""


class UnknownAdapterError(LookupError):
    """A request or an unload named an adapter that is not served."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the LoRA adapter `{name}` is not loaded")
        self.name = name


@dataclass(frozen=True, slots=True)
class LoraConfig:
    name: str  # what requests select it by (`model: NAME`)
    path: str
    rank: int
    alpha: float
    scaling: float  # alpha / r, or alpha / sqrt(r) under rsLoRA
    targets: frozenset[str]  # a subset of TARGETS
    fingerprint: str  # content hash (hex): salts the block hashes of its requests
    base_model: str  # base_model_name_or_path as written (informational)

    @classmethod
    def load(cls, name: str, path: str | os.PathLike) -> LoraConfig:
        check_name(name)
        d = Path(path)
        try:
            cfg = json.loads((d / CONFIG_FILE).read_text())
        except FileNotFoundError:
            raise AdapterError(f"adapter {name!r}: no {CONFIG_FILE} in {d}") from None
        except ValueError as exc:
            raise AdapterError(f"adapter {name!r}: {d / CONFIG_FILE} is not JSON: {exc}") from None
        if not (d / WEIGHTS_FILE).is_file():
            raise AdapterError(f"adapter {name!r}: no {WEIGHTS_FILE} in {d}")
        _refuse_unsupported(name, cfg)
        rank = cfg.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise AdapterError(f"adapter {name!r}: r must be a positive integer, got {rank!r}")
        alpha = cfg.get("lora_alpha", 8)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise AdapterError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
        scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
        return cls(
            name=name,
            path=str(d),
            rank=rank,
            alpha=float(alpha),
            scaling=scaling,
            targets=_targets(name, cfg.get("target_modules")),
            fingerprint=adapter_fingerprint(d).hex(),
            base_model=str(cfg.get("base_model_name_or_path") or ""),
        )


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AdapterError(f"adapter name {name!r} must be 1-128 of [A-Za-z0-9._:/-]")


def parse_lora_flag(value: str) -> tuple[str, str]:
    """`NAME=DIR`, as --lora takes it."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise AdapterError(f"--lora takes NAME=DIR, got {value!r}")
    check_name(name)
    return name, path


def _refuse_unsupported(name: str, cfg: dict) -> None:
    def bad(field: str, why: str) -> AdapterError:
        return AdapterError(f"adapter {name!r}: {field} {why} is not supported")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", repr(cfg.get("peft_type")))
    if cfg.get("use_dora"):
        raise bad("use_dora", "(DoRA)")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", repr(cfg.get("bias")))
    if cfg.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out", "(Conv1D layouts)")
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if cfg.get(field):
            raise bad(field, repr(cfg[field]))
    if cfg.get("layer_replication"):
        raise bad("layer_replication", repr(cfg["layer_replication"]))


def _targets(name: str, value: object) -> frozenset[str]:
    """PEFT's target_modules: a list of module names (suffixes), "all-linear", or a regex
    over full module names. Only the seven projections above may match."""
    if value == "all-linear":
        return frozenset(TARGETS)
    if isinstance(value, str):
        hits = {t for t in TARGETS if re.fullmatch(value, f"model.layers.0.{_PARENT[t]}.{t}")}
        if not hits:
            raise AdapterError(f"adapter {name!r}: target_modules {value!r} matches no projection")
        return frozenset(hits)
    if not isinstance(value, list) or not value:
        raise AdapterError(f"adapter {name!r}: target_modules must be a list, got {value!r}")
    targets = {str(v).rsplit(".", 1)[-1] for v in value}
    unknown = sorted(targets - set(TARGETS))
    if unknown:
        raise AdapterError(
            f"adapter {name!r}: target_modules {unknown} are not supported (only {list(TARGETS)})"
        )
    return frozenset(targets)
