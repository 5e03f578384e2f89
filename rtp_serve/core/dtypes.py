"""Names of the dtypes the engine runs and stores KV in (their torch dtypes: engine/dtypes.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
# What a user may ask to compute in: "auto" serves the checkpoint's own dtype (resolve_dtype).
MODEL_DTYPES = ("auto", *DTYPES)
# How projection weights are stored: "auto" as the model dtype, "int8" weight-only quantized,
# "w8a8" INT8 weights with activations quantized per token, multiplied in integers (CPU).
WEIGHT_DTYPES = ("auto", "int8", "w8a8")
# Those that store the projections one byte per parameter.
INT8_WEIGHT_DTYPES = ("int8", "w8a8")
# How the KV cache is stored: "auto" as the model dtype, any of DTYPES, or "int8" with a
# float32 scale per block and kv head (rtp_serve/kernels/kv_quant.py).
KV_DTYPES = ("auto", *DTYPES, "int8")
# Every dtype a tensor here is stored in: compute dtypes and the int8 KV cache.
STORAGE_DTYPES = (*DTYPES, "int8")


def resolve_dtype(dtype: str, model_dir: str | os.PathLike) -> str:
    """The compute dtype for a --dtype value: "auto" is the checkpoint's (config.json's
    `torch_dtype`, or `dtype` as transformers 5 writes it), float32 if it names none of
    DTYPES. Every service resolves it the same way from the same directory."""
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    config = json.loads((Path(model_dir) / "config.json").read_text())
    saved = config.get("torch_dtype") or config.get("dtype")
    return saved if saved in DTYPES else "float32"


def resolve_kv_dtype(dtype: str, kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return dtype if kv_dtype == "auto" else kv_dtype


def kv_numerics(dtype: str, weight_dtype: str = "auto", kv_dtype: str = "auto") -> str:
    """What decides a KV block's values besides the tokens: the compute dtype, the weight
    storage and the KV dtype, as the one string the cache salt is made from. The plain case
    (weights and KV in the model dtype) is the dtype's name alone."""
    kv = resolve_kv_dtype(dtype, kv_dtype)
    if weight_dtype == "auto" and kv == dtype:
        return dtype
    return f"{dtype};weights={weight_dtype};kv={kv}"
