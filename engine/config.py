"""Frozen configuration of the engine: how to run the model (what it is: core/model_config.py).

Runtime facts (how many KV blocks fit, the resolved context length) live in `EngineLimits`,
computed once at start-up and never written back into config.
"""

from __future__ import annotations

from dataclasses import dataclass

from rtp_serve.core.dtypes import DTYPES, WEIGHT_DTYPES, resolve_kv_dtype
from rtp_serve.core.sampling_params import MAX_SPECULATIVE_TOKENS
from rtp_serve.kernels import affinity

SPECULATIVE_METHODS = (None, "ngram", "draft")
LOAD_FORMATS = ("auto", "mmap", "read", "fastsafetensors")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to run a model. Validated when built; never mutated afterwards."""

    model: str
    dtype: str = "float32"
    # "auto": projections stored in `dtype`; "int8": weight-only INT8, per output channel;
    # "w8a8": INT8 weights and per-token INT8 activations (rtp_serve/kernels/w8a8.py, CPU).
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
    # Map a large CPU pool's pages in the background while the cores idle (engine/
    # prefault.py), instead of on each block's first write.
    prefault_kv: bool = False
    # T1, a host-memory tier under the KV pool (engine/host_tier.py); 0: none.
    host_kv_cache_bytes: int = 0
    max_num_seqs: int = 64
    # Requests that may wait for a slot or for blocks; past it a new one is refused at once
    # (QueueFullError), so a caller can go elsewhere instead of queueing without bound.
    max_num_waiting: int = 256
    max_num_batched_tokens: int = 2048
    # While requests decode, a step computes no more prompt tokens than keep its predicted
    # time (the step cost fitted from this engine's steps) within this many milliseconds,
    # and no fewer than its GEMMs need to run efficiently (engine/llm_engine.py: ITL
    # target); 0: off, the token budget alone.
    itl_target_ms: float = 0.0
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # torch intra-op threads; None leaves torch's default. Workers sharing a machine set it.
    num_threads: int | None = None
    # Bind the engine thread and its helpers to CPUs of their own (rtp_serve/kernels/
    # affinity.py): "off", "auto" (when the process owns exactly as many CPUs as threads),
    # or a CPU list ("0-3").
    thread_binding: str = "off"
    # Picks the random seeds of requests that bring none (engine/sampling_noise.py).
    seed: int = 0
    # Speculative decoding (engine/spec_decode/): None (off), "ngram" or "draft"; each decoding
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
    # Share each priority class between tenants by weighted tokens served
    # (engine/fair_queue.py); False: first come, first served within a class.
    fair_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        resolve_kv_dtype(self.dtype, self.kv_dtype)  # raises for a name it does not know
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}"
            )
        if self.weight_dtype == "w8a8" and self.device != "cpu":
            raise ValueError(f"weight_dtype 'w8a8' runs on the CPU only, not {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        for name in ("block_size", "max_num_seqs", "max_num_waiting", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.itl_target_ms >= 0 or self.itl_target_ms == float("inf"):
            raise ValueError(f"itl_target_ms must be >= 0 and finite, got {self.itl_target_ms}")
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
        affinity.check(self.thread_binding)

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
    # The engine's KV arrays: torch tensors, or numpy arrays (the simulated engine, which
    # has no torch).
    numpy: bool = False


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Facts resolved at start-up from config, model and memory."""

    num_kv_blocks: int
    max_model_len: int
    bytes_per_block: int
