"""An adapter's tensors mapped onto the engine's fused projections.

The engine runs q/k/v as one `qkv` projection and gate/up as one `gate_up` (models/llama.py),
so an adapter's per-module pairs are fused the same way. For a fused projection whose
outputs are [q | k | v], the update of each targeted part i is `s * (x A_i^T) B_i^T` into
its own output columns; stacking the A's gives one [in, R] matrix, and the B's go on the
diagonal of one [R, out] matrix (zeros elsewhere), so the whole update is two GEMMs:

        x [T, in] @ A [in, r_q + r_k + r_v]  ->  [T, R]
        [T, R]    @ B [R, out]               ->  [T, out],   B = | s*B_q^T   0       0     |
                                                                 |   0     s*B_k^T   0     |
                                                                 |   0       0     s*B_v^T |

An untargeted part has no rows in A and its columns of B stay zero. The scaling s is folded
into B once, at load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.lora.peft_config import WEIGHTS_FILE, AdapterError, LoraConfig

# The engine's projections, in the order a layer runs them, and the HF modules fused in each.
QKV, OUT, GATE_UP, DOWN = range(4)
_FUSED = {
    QKV: ("q_proj", "k_proj", "v_proj"),
    OUT: ("o_proj",),
    GATE_UP: ("gate_proj", "up_proj"),
    DOWN: ("down_proj",),
}
_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)"
    r"\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight"
)


@dataclass(frozen=True, slots=True)
class LoraPair:
    a: torch.Tensor  # [in, R]
    b: torch.Tensor  # [R, out], the scaling folded in

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(torch.mm(x, self.a), self.b)


@dataclass(frozen=True, slots=True)
class LoraWeights:
    config: LoraConfig
    # layers[i][p]: the pair of projection p (QKV, OUT, GATE_UP, DOWN) of layer i, or None.
    layers: list[tuple[LoraPair | None, ...]]

    @property
    def nbytes(self) -> int:
        return sum(
            p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
            for layer in self.layers
            for p in layer
            if p is not None
        )


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each HF projection."""
    h, q, kv, i = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def load_lora_weights(
    config: LoraConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> LoraWeights:
    """Read, check against the base model, and fuse (raises AdapterError naming the tensor)."""
    raw = load_file(Path(config.path) / WEIGHTS_FILE)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise AdapterError(
                f"adapter {config.name!r}: tensor {key!r} is not a supported LoRA weight"
            )
        layer, module, side = int(m[1]), m[2], m[3]
        if module not in config.targets or layer >= model.num_layers:
            raise AdapterError(f"adapter {config.name!r}: tensor {key!r} is outside target_modules")
        pairs.setdefault((layer, module), {})[side] = t
    shapes = _shapes(model)
    layers = []
    for i in range(model.num_layers):
        fused: list[LoraPair | None] = []
        for modules in _FUSED.values():
            a_parts, b_parts, outs = [], [], []
            for module in modules:
                fan_in, fan_out = shapes[module]
                outs.append(fan_out)
                pair = pairs.get((i, module))
                if pair is None:
                    b_parts.append(None)
                    continue
                a, b = pair.get("A"), pair.get("B")
                if a is None or b is None:
                    raise AdapterError(
                        f"adapter {config.name!r}: layer {i} {module} lacks lora_{'B' if a is not None else 'A'}"
                    )
                if tuple(a.shape) != (config.rank, fan_in) or tuple(b.shape) != (
                    fan_out,
                    config.rank,
                ):
                    raise AdapterError(
                        f"adapter {config.name!r}: layer {i} {module} has A {tuple(a.shape)}, "
                        f"B {tuple(b.shape)}; expected ({config.rank}, {fan_in}), ({fan_out}, {config.rank})"
                    )
                a_parts.append(a.float())
                b_parts.append(b.float())
            if not a_parts:
                fused.append(None)
                continue
            rank = config.rank * len(a_parts)
            big_b = torch.zeros(rank, sum(outs))
            r0, c0 = 0, 0
            for b, out in zip(b_parts, outs, strict=True):
                if b is not None:
                    big_b[r0 : r0 + config.rank, c0 : c0 + out] = b.t() * config.scaling
                    r0 += config.rank
                c0 += out
            a = torch.cat(a_parts).t()
            fused.append(LoraPair(_to(a, dtype, device), _to(big_b, dtype, device)))
        layers.append(tuple(fused))
    return LoraWeights(config, layers)


def _to(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).contiguous()
