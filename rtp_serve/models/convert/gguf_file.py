"""One GGUF file, read with llama.cpp's `gguf` package: validated, its HF config, its tensors.

GGUF stores hyperparameters as `<arch>.<key>` metadata and tensors under llama.cpp's names
(`blk.3.attn_q.weight`), quantized in blocks. This module maps both back to what a
HuggingFace checkpoint of the same family holds, dequantizing with `gguf.quants.dequantize`
(the reference implementation, so converted weights equal what llama.cpp itself computes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A file that is not a usable GGUF checkpoint; the message names the file."""


@dataclass(frozen=True, slots=True)
class Family:
    architecture: str  # HF `architectures[0]`
    model_type: str
    # llama.cpp's convert script reorders Llama's q/k rows for its rotary kernel (below).
    permuted_qk: bool


# general.architecture -> HF family. llama.cpp converts Mistral (v0.x) as "llama": the same
# math with no sliding window, so it comes back as a LlamaForCausalLM.
FAMILIES = {
    "llama": Family("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Per-layer names, in HF module order (the order tensors are written in).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_ORDER = {name: i for i, name in enumerate(_LAYER_NAMES)}


def _f32(value: float) -> float:
    """A float32 from the file as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06): what the original config.json said."""
    return float(str(np.float32(value)))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, back to HF's rotate_half layout.

    HF rotates the two halves of each head against each other; llama.cpp's rope rotates
    adjacent pairs, so its convert script interleaves the halves, per head:

        HF rows of one head:    x0 x1 .. x31 | y0 y1 .. y31
        GGUF rows of that head: x0 y0 x1 y1 .. x31 y31

    Viewing each head as (pairs, 2) and swapping the axes restores the halves.
    """
    pairs = w.shape[0] // n_head // 2
    return w.reshape(n_head, pairs, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFModel:
    """A validated GGUF checkpoint of a supported family (raises GGUFError otherwise)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader  # imported here: only conversion needs it

        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot read it ({exc.strerror})") from exc
        if magic != _MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (it does not start with b'GGUF')")
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, KeyError, IndexError, OverflowError) as exc:
            raise GGUFError(f"{self.path}: truncated or corrupt GGUF file ({exc})") from exc
        for t in self.reader.tensors:
            if t.data.nbytes != t.n_bytes:  # numpy slices past the end of a memmap silently
                raise GGUFError(f"{self.path}: truncated GGUF file (tensor {t.name} is cut off)")
        self.arch = str(self.field("general.architecture", "?"))
        if self.arch not in FAMILIES:
            raise GGUFError(
                f"{self.path}: architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(FAMILIES)})"
            )
        self.family = FAMILIES[self.arch]
        self._tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _hparam(self, key: str, default: Any = None) -> Any:
        value = self.field(f"{self.arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{self.path}: metadata {self.arch}.{key} is missing")
        if isinstance(value, list):
            raise GGUFError(f"{self.path}: per-layer {self.arch}.{key} is not supported")
        return value

    @property
    def tied_embeddings(self) -> bool:
        return "output.weight" not in self._tensors

    def hf_config(self, dtype: str) -> dict[str, Any]:
        """config.json for this checkpoint (transformers 4.x keys, which 5.x also reads)."""
        if "rope_freqs.weight" in self._tensors:
            raise GGUFError(f"{self.path}: llama3 rope scaling (rope_freqs) is not supported")
        hidden = int(self._hparam("embedding_length"))
        heads = int(self._hparam("attention.head_count"))
        head_dim = int(self._hparam("attention.key_length", hidden // heads))
        if int(self._hparam("rope.dimension_count", head_dim)) != head_dim:
            raise GGUFError(f"{self.path}: partial rotary embeddings are not supported")
        tokens = self.field("tokenizer.ggml.tokens") or []
        vocab = int(self._hparam("vocab_size", len(tokens) or None))
        cfg: dict[str, Any] = {
            "architectures": [self.family.architecture],
            "model_type": self.family.model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(self._hparam("feed_forward_length")),
            "num_hidden_layers": int(self._hparam("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._hparam("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": int(self._hparam("context_length")),
            "rms_norm_eps": _f32(self._hparam("attention.layer_norm_rms_epsilon")),
            "rope_theta": _f32(self._hparam("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "attention_dropout": 0.0,
            "tie_word_embeddings": self.tied_embeddings,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
            "torch_dtype": dtype,
            "use_cache": True,
        }
        if self.family.model_type == "llama":
            bias = "blk.0.attn_q.bias" in self._tensors
            cfg |= {"attention_bias": bias, "mlp_bias": False, "pretraining_tp": 1}
        else:
            cfg |= {"use_sliding_window": False, "sliding_window": None}
            cfg["max_window_layers"] = cfg["num_hidden_layers"]
        return cfg

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self.field(f"{self.arch}.rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": _f32(self._hparam("rope.scaling.factor"))}
        raise GGUFError(f"{self.path}: rope scaling {kind!r} is not supported")

    def hf_name(self, gguf_name: str) -> str:
        base, _, kind = gguf_name.rpartition(".")
        parts = base.split(".")
        if len(parts) == 1 and base in _GLOBAL_NAMES and kind == "weight":
            return f"{_GLOBAL_NAMES[base]}.weight"
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{kind}"
        raise GGUFError(f"{self.path}: tensor {gguf_name!r} has no HF counterpart (unsupported)")

    def _order(self, gguf_name: str) -> tuple[int, int, str]:
        parts = gguf_name.split(".")
        if parts[0] == "blk":
            return (1, int(parts[1]) * 100 + _LAYER_ORDER.get(parts[2], 99), gguf_name)
        return ({"token_embd": 0, "output_norm": 2, "output": 3}.get(parts[0], 4), 0, gguf_name)

    @property
    def tensor_names(self) -> list[str]:
        """GGUF tensor names in HF model order (embeddings, layer by layer, norm, head)."""
        return sorted(self._tensors, key=self._order)

    def dequantize(self, gguf_name: str) -> np.ndarray:
        """One tensor as float32 in HF shape ([out, in]), as `gguf.quants.dequantize` gives it."""
        from gguf.quants import dequantize

        t = self._tensors[gguf_name]
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise GGUFError(
                f"{self.path}: tensor {t.name} is {t.tensor_type.name}, which cannot be dequantized"
            ) from exc
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest dim first
        return np.array(values, dtype=np.float32).reshape(shape)

    def hf_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every tensor, q/k un-permuted where the family needs it."""
        heads = int(self._hparam("attention.head_count"))
        kv_heads = int(self._hparam("attention.head_count_kv", heads))
        for gguf_name in self.tensor_names:
            name = self.hf_name(gguf_name)
            values = self.dequantize(gguf_name)
            if self.family.permuted_qk and ".attn_q." in gguf_name:
                values = unpermute_qk(values, heads)
            elif self.family.permuted_qk and ".attn_k." in gguf_name:
                values = unpermute_qk(values, kv_heads)
            yield name, torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
