"""Frozen configuration: what the model is (read from config.json) and how to run it.

Runtime facts (how many KV blocks fit, the resolved context length) live in `EngineLimits`,
computed once at start-up and never written back into config.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from rtp_serve.engine.dtypes import DTYPES, WEIGHT_DTYPES, resolve_kv_dtype
from rtp_serve.engine.spec.adaptive import MAX_SPECULATIVE_TOKENS

SPECULATIVE_METHODS = (None, "ngram", "draft")
LOAD_FORMATS = ("auto", "mmap", "read", "fastsafetensors")

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


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to run a model. Validated when built; never mutated afterwards."""

    model: str
    dtype: str = "float32"
    # "auto": projections stored in `dtype`; "int8": weight-only INT8, per output channel.
    weight_dtype: str = "auto"
    # "auto": the KV cache in `dtype`; or a narrower dtype than the model (bf16 KV, fp32 model).
    kv_dtype: str = "auto"
    device: str = "cpu"
    # How the checkpoint comes in (engine/weights.py): "auto" maps it on the CPU and reads
    # it for a device; "mmap", "read" or "fastsafetensors" (that package, the gpu extra).
    load_format: str = "auto"
    # Decode batch sizes captured as CUDA graphs at start (engine/cuda_graphs.py), on CUDA
    # with the Triton backend; () runs every step eagerly. Ignored on CPU.
    cuda_graph_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    block_size: int = 16
    # KV pool size: an explicit block count wins over the memory budget.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 << 20
    # T1, a host-memory tier under the KV pool (engine/host_tier.py); 0: none.
    host_kv_cache_bytes: int = 0
    max_num_seqs: int = 64
    # Requests that may wait for a slot or for blocks; past it a new one is refused at once
    # (QueueFullError), so a caller can go elsewhere instead of queueing without bound.
    max_num_waiting: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # torch intra-op threads; None leaves torch's default. Workers sharing a machine set it.
    num_threads: int | None = None
    # Picks the random seeds of requests that bring none (engine/sampling_noise.py).
    seed: int = 0
    # Speculative decoding (engine/spec/): None (off), "ngram" or "draft"; each decoding
    # request proposes up to num_speculative_tokens drafts a step (adaptive; per request too).
    speculative: str | None = None
    num_speculative_tokens: int = 3
    # "draft": the draft model's directory (None: the target itself), and how many of its
    # first layers draft (None: all of a draft model's; a quarter of the target's).
    draft_model: str | None = None
    draft_num_layers: int | None = None
    # Multi-LoRA (engine/lora/): adapters served from the start, as (name, PEFT directory);
    # more are added at run time. At most max_loras are resident and run in one step.
    loras: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        resolve_kv_dtype(self.dtype, self.kv_dtype)  # raises for a name it does not know
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        for name in ("block_size", "max_num_seqs", "max_num_waiting", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.host_kv_cache_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes must be >= 0, got {self.host_kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if any(n <= 0 for n in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive, got {self.cuda_graph_sizes}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        if self.draft_num_layers is not None and self.draft_num_layers <= 0:
            raise ValueError(f"draft_num_layers must be positive, got {self.draft_num_layers}")
        if self.speculative != "draft" and (self.draft_model or self.draft_num_layers):
            raise ValueError('draft_model and draft_num_layers need speculative="draft"')
        if self.max_loras <= 0:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}")
        object.__setattr__(self, "loras", tuple((str(n), str(p)) for n, p in self.loras))
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")

    @property
    def resolved_kv_dtype(self) -> str:
        return resolve_kv_dtype(self.dtype, self.kv_dtype)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one token's KV, as it crosses the wire: per layer, K and V of
    [num_kv_heads, head_dim] in `dtype`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Facts resolved at start-up from config, model and memory."""

    num_kv_blocks: int
    max_model_len: int
    bytes_per_block: int
