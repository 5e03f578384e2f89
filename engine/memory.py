"""How much memory a worker may give its KV cache, from what the machine (or its container)
has: the default when no explicit size is configured.

    budget = available * fraction / share - weights

`available` is MemAvailable, or what is left under the cgroup's limit when a container has a
smaller one; `share` is the number of workers started on this machine (the launcher knows
it); `weights` are the model's parameters in the dtype the worker runs them in.

On a CUDA device the pool lives in device memory, so it is sized from the device instead:

    budget = min(free, total * fraction / share) - weights - activations - graph pool

(`cuda_memory`: torch.cuda.mem_get_info; the only torch use here, imported when called.)
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rtp_serve.core.dtypes import INT8_WEIGHT_DTYPES

if TYPE_CHECKING:
    from rtp_serve.core.model_config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_FRACTION = 0.5  # of the available memory, for weights + KV of all workers here
DEFAULT_CUDA_FRACTION = 0.9  # of a GPU's memory: nothing else of the worker's lives there
# cuBLAS/Triton workspaces and allocator fragmentation, past what activation_bytes counts.
CUDA_OVERHEAD_BYTES = 512 << 20
MIN_KV_BYTES = 64 << 20  # below this a worker could hold only a few short requests
_NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a huge number
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
_SCALE_BYTES = 4  # an int8 cache's float32 scale per block, layer, K/V and kv head


@dataclass(frozen=True, slots=True)
class KVBudget:
    """The chosen KV size and how it was reached (for the start-up log line)."""

    kv_bytes: int
    available_bytes: int
    weights_bytes: int
    fraction: float
    share: int
    reserved_bytes: int = 0  # a GPU's activations, graph pool and workspaces
    device: str = "host"
    total_bytes: int = 0  # a GPU's whole memory (available_bytes: what is free of it)

    def describe(self) -> str:
        gib, mib = 1 << 30, 1 << 20
        weights = f"{self.weights_bytes / mib:.0f} MiB of weights"
        share = f"x {self.fraction:g} / {self.share} worker(s)"
        if self.device == "host":
            return (
                f"{self.kv_bytes / mib:.0f} MiB = {self.available_bytes / gib:.1f} GiB "
                f"available {share} - {weights}"
            )
        return (
            f"{self.kv_bytes / mib:.0f} MiB = min({self.available_bytes / gib:.1f} GiB free on "
            f"{self.device}, {self.total_bytes / gib:.1f} GiB {share}) - {weights} - "
            f"{self.reserved_bytes / mib:.0f} MiB of activations and graphs"
        )


def available_memory_bytes(
    proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")
) -> int:
    """Memory this process can still use: MemAvailable, capped by a cgroup limit."""
    available = _meminfo_available(proc / "meminfo")
    for limit_file, usage_file in (
        (cgroup / "memory.max", cgroup / "memory.current"),  # cgroup v2
        (cgroup / "memory" / "memory.limit_in_bytes", cgroup / "memory" / "memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and limit < _NO_LIMIT and usage is not None:
            available = min(available, max(0, limit - usage))
            break
    return available


def kv_bytes_per_token(model: ModelConfig, dtype: str) -> int:
    """K and V of every layer for one token (an int8 cache's per-block scales not counted:
    see kv_bytes_per_block)."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * ITEMSIZE[dtype]


def kv_bytes_per_block(model: ModelConfig, dtype: str, block_size: int) -> int:
    """One block of the pool: its tokens' K and V, plus the scales of an int8 cache."""
    scales = 2 * model.num_layers * model.num_kv_heads * _SCALE_BYTES if dtype == "int8" else 0
    return block_size * kv_bytes_per_token(model, dtype) + scales


def weights_bytes(model_dir: str | os.PathLike, dtype: str, weight_dtype: str = "auto") -> int:
    """The model's parameters in `dtype`, counted from the safetensors headers; with
    `weight_dtype` "int8" or "w8a8" the projections (`*_proj.weight`) take one byte per
    parameter."""
    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            int8 = weight_dtype in INT8_WEIGHT_DTYPES and name.endswith("_proj.weight")
            total += math.prod(t["shape"]) * (1 if int8 else ITEMSIZE[dtype])
    return total


def kv_budget(
    model_dir: str | os.PathLike,
    dtype: str,
    fraction: float = DEFAULT_FRACTION,
    share: int = 1,
    available: int | None = None,
    weight_dtype: str = "auto",
) -> KVBudget:
    _check(fraction, share)
    available = available_memory_bytes() if available is None else available
    weights = weights_bytes(model_dir, dtype, weight_dtype)
    kv = int(available * fraction / share) - weights
    budget = KVBudget(max(kv, MIN_KV_BYTES), available, weights, fraction, share)
    if kv < MIN_KV_BYTES:
        log.warning("little memory for the KV cache (%s); using %d MiB", budget.describe(),
                    MIN_KV_BYTES >> 20)  # fmt: skip
    return budget


def cuda_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, as the driver reports them."""
    import torch

    return torch.cuda.mem_get_info(torch.device(device))


def activation_bytes(model: ModelConfig, dtype: str, tokens: int, rows: int) -> int:
    """A generous estimate of one step's transient tensors: per token its hidden states,
    q/k/v and the MLP's gate, up and product; per sampled row float32 logits and the
    sampler's copies of them (probabilities, noise, a sort)."""
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_token = (4 * model.hidden_size + qkv + 3 * model.intermediate_size) * ITEMSIZE[dtype]
    return tokens * per_token + rows * 4 * model.vocab_size * 4


def int8_dequant_bytes(model: ModelConfig, dtype: str) -> int:
    """On CUDA an INT8 projection is dequantized whole on every call (RowsLinear.dense in
    rtp_serve/kernels/linear.py): the largest one's float32 copy, its scaled product and the
    `dtype` result, transiently."""
    hidden, q = model.hidden_size, model.num_heads * model.head_dim
    qkv = (q + 2 * model.num_kv_heads * model.head_dim) * hidden
    largest = max(qkv, q * hidden, 2 * model.intermediate_size * hidden)
    return largest * (4 + 4 + ITEMSIZE[dtype])


def cuda_kv_budget(
    weights: int,
    free: int,
    total: int,
    reserved: int,
    fraction: float = DEFAULT_CUDA_FRACTION,
    share: int = 1,
    device: str = "cuda",
) -> KVBudget:
    """The KV pool of a CUDA worker: its share of the device (never more than is free now,
    other processes' memory included) less the weights and the `reserved` transient memory."""
    _check(fraction, share)
    usable = min(free, int(total * fraction / share))
    kv = usable - weights - reserved
    budget = KVBudget(
        max(kv, MIN_KV_BYTES), free, weights, fraction, share, reserved, device, total
    )
    if kv < MIN_KV_BYTES:
        log.warning("little device memory for the KV cache (%s); using %d MiB",
                    budget.describe(), MIN_KV_BYTES >> 20)  # fmt: skip
    return budget


def kv_budget_for_device(
    device: str,
    model_dir: str | os.PathLike,
    model: ModelConfig,
    dtype: str,
    fraction: float | None,
    share: int,
    weight_dtype: str,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    graph_rows: int,
    device_memory: Callable[[str], tuple[int, int]] | None = None,
) -> KVBudget:
    """The budget for a worker on `device`: from the device's free/total memory on CUDA
    (`device_memory`, default cuda_memory; a test passes its own numbers), else from the
    host's (kv_budget).
    `fraction` None: the device's default. `graph_rows`: the largest CUDA graph (0: none)."""
    if not device.startswith("cuda"):
        return kv_budget(
            model_dir, dtype, DEFAULT_FRACTION if fraction is None else fraction, share,
            weight_dtype=weight_dtype,
        )  # fmt: skip
    free, total = (device_memory or cuda_memory)(device)
    # Eager steps and the graphs' private pool hold their activations apart.
    reserved = (
        activation_bytes(model, dtype, max_num_batched_tokens, max_num_seqs)
        + activation_bytes(model, dtype, graph_rows, graph_rows)
        + CUDA_OVERHEAD_BYTES
        + (int8_dequant_bytes(model, dtype) if weight_dtype == "int8" else 0)
    )
    return cuda_kv_budget(
        weights_bytes(model_dir, dtype, weight_dtype),
        free,
        total,
        reserved,
        DEFAULT_CUDA_FRACTION if fraction is None else fraction,
        share,
        device,
    )


def _check(fraction: float, share: int) -> None:
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    if share < 1:
        raise ValueError(f"memory share must be at least 1, got {share}")


def _meminfo_available(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no MemAvailable in {path}")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
