"""How much memory a worker may give its KV cache, from what the machine (or its container)
has: the default when no explicit size is configured.

    budget = available * fraction / share - weights

`available` is MemAvailable, or what is left under the cgroup's limit when a container has a
smaller one; `share` is the number of workers started on this machine (the launcher knows
it); `weights` are the model's parameters in the dtype the worker runs them in. Torch-free.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rtp_serve.core.model_config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_FRACTION = 0.5  # of the available memory, for weights + KV of all workers here
MIN_KV_BYTES = 64 << 20  # below this a worker could hold only a few short requests
_NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a huge number
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
_SCALE_BYTES = 4  # an int8 cache's float32 scale per block, layer, K/V and kv head


@dataclass(frozen=True, slots=True)
class KVBudget:
    """The chosen KV size and how it was reached (for the start-up log line)."""

    kv_bytes: int
    available_bytes: int
    weights_bytes: int
    fraction: float
    share: int

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"{self.kv_bytes / (1 << 20):.0f} MiB = {self.available_bytes / gib:.1f} GiB "
            f"available x {self.fraction:g} / {self.share} worker(s) - "
            f"{self.weights_bytes / (1 << 20):.0f} MiB of weights"
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
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * _ITEMSIZE[dtype]


def kv_bytes_per_block(model: ModelConfig, dtype: str, block_size: int) -> int:
    """One block of the pool: its tokens' K and V, plus the scales of an int8 cache."""
    scales = 2 * model.num_layers * model.num_kv_heads * _SCALE_BYTES if dtype == "int8" else 0
    return block_size * kv_bytes_per_token(model, dtype) + scales


def weights_bytes(model_dir: str | os.PathLike, dtype: str, weight_dtype: str = "auto") -> int:
    """The model's parameters in `dtype`, counted from the safetensors headers; with
    `weight_dtype` "int8" the projections (`*_proj.weight`) take one byte per parameter."""
    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            int8 = weight_dtype == "int8" and name.endswith("_proj.weight")
            total += math.prod(t["shape"]) * (1 if int8 else _ITEMSIZE[dtype])
    return total


def kv_budget(
    model_dir: str | os.PathLike,
    dtype: str,
    fraction: float = DEFAULT_FRACTION,
    share: int = 1,
    available: int | None = None,
    weight_dtype: str = "auto",
) -> KVBudget:
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    if share < 1:
        raise ValueError(f"memory share must be at least 1, got {share}")
    available = available_memory_bytes() if available is None else available
    weights = weights_bytes(model_dir, dtype, weight_dtype)
    kv = int(available * fraction / share) - weights
    budget = KVBudget(max(kv, MIN_KV_BYTES), available, weights, fraction, share)
    if kv < MIN_KV_BYTES:
        log.warning("little memory for the KV cache (%s); using %d MiB", budget.describe(),
                    MIN_KV_BYTES >> 20)  # fmt: skip
    return budget


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
