"""An adapter's tensors mapped onto the engine's fused projections.

The engine runs q/k/v as one `qkv` projection and gate/up as one `gate_up` (models/llama.py),
so an adapter's per-module pairs are mapped onto those. For a fused projection whose
outputs are [q | k | v], the update of each targeted part i is `s * (x A_i^T) B_i^T` into
its own output columns. The A's are stacked into one [in, R] matrix, so one GEMM computes
every part's low-rank activations; each part's B then writes its own column range:

        t = x [T, in] @ [A_q | A_k | A_v]                  -> [T, r_q + r_k + r_v]
        y[:, q cols] += t[:, :r_q] @ s*B_q^T, y[:, k cols] += ..., y[:, v cols] += ...

(One block-diagonal B would be one GEMM fewer, but reads mostly zeros: a decode step is
bound by the bytes it reads.) An untargeted part has no columns; s is folded into B at load.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from rtp_serve.core.model_config import ModelConfig
from rtp_serve.core.peft_config import WEIGHTS_FILE, AdapterError, LoraConfig

# x [T, k] @ w [k, n]: torch.mm, or the compiled kernel for decode-sized fp32 (lora_ops).
MatMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

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
class LoraPart:
    """One targeted module of a fused projection: its B and where it reads and writes."""

    rows: slice  # its columns of the stacked activations t
    cols: slice  # its columns of the fused projection's output
    b: torch.Tensor  # [r, out_part], the scaling folded in


@dataclass(frozen=True, slots=True)
class LoraPair:
    a: torch.Tensor  # [in, R]: the targeted parts' A^T side by side
    parts: tuple[LoraPart, ...]

    @property
    def nbytes(self) -> int:
        return (self.a.numel() + sum(p.b.numel() for p in self.parts)) * self.a.element_size()

    def add(self, x: torch.Tensor, y: torch.Tensor, mm: MatMul = torch.mm) -> None:
        """y += update(x), in place."""
        t = mm(x, self.a)
        for part in self.parts:
            y[:, part.cols].add_(mm(t[:, part.rows], part.b))


@dataclass(frozen=True, slots=True)
class LoraWeights:
    config: LoraConfig
    # layers[i][p]: the pair of projection p (QKV, OUT, GATE_UP, DOWN) of layer i, or None.
    layers: list[tuple[LoraPair | None, ...]]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for layer in self.layers for p in layer if p is not None)


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
            a_parts: list[torch.Tensor] = []
            parts: list[LoraPart] = []
            c0 = 0
            for module in modules:
                fan_in, fan_out = shapes[module]
                pair = pairs.get((i, module))
                if pair is not None:
                    a, b = _checked(config, i, module, pair, fan_in, fan_out)
                    r0 = config.rank * len(a_parts)
                    a_parts.append(a.float())
                    b = _to(b.float().t() * config.scaling, dtype, device)
                    parts.append(LoraPart(slice(r0, r0 + config.rank), slice(c0, c0 + fan_out), b))
                c0 += fan_out
            if not a_parts:
                fused.append(None)
                continue
            fused.append(LoraPair(_to(torch.cat(a_parts).t(), dtype, device), tuple(parts)))
        layers.append(tuple(fused))
    return LoraWeights(config, layers)


def _checked(config: LoraConfig, layer: int, module: str, pair: dict, fan_in: int, fan_out: int):
    a, b = pair.get("A"), pair.get("B")
    if a is None or b is None:
        missing = "lora_B" if a is not None else "lora_A"
        raise AdapterError(f"adapter {config.name!r}: layer {layer} {module} lacks {missing}")
    r = config.rank
    if tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
        raise AdapterError(
            f"adapter {config.name!r}: layer {layer} {module} has A {tuple(a.shape)}, "
            f"B {tuple(b.shape)}; expected ({r}, {fan_in}), ({fan_out}, {r})"
        )
    return a, b


def _to(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).contiguous()
