"""Names of the dtypes the engine runs and stores KV in, and their torch dtypes.

The one map from a dtype's name (config, flags, the KV wire format) to a torch dtype. torch
is imported only when a torch dtype is asked for, so config code can import the names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
# How projection weights are stored: "auto" as the model dtype, "int8" weight-only quantized.
WEIGHT_DTYPES = ("auto", "int8")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name`; ValueError for a name not in DTYPES."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (one of {DTYPES})")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype in DTYPES (inverse of torch_dtype)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype}")
    return name
