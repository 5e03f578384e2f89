"""The one map between a dtype's name (core/dtypes.py) and its torch dtype."""

from __future__ import annotations

import torch

from rtp_serve.core.dtypes import STORAGE_DTYPES


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name`; ValueError for a name not in STORAGE_DTYPES."""
    if name not in STORAGE_DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (one of {STORAGE_DTYPES})")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype in STORAGE_DTYPES (inverse of torch_dtype)."""
    name = str(dtype).removeprefix("torch.")
    if name not in STORAGE_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}")
    return name
