"""config.json and the chat template read as transformers 4 and 5 write them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rtp_serve.core.model_config import ModelConfig, RopeScaling
from rtp_serve.core.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


def _with_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_transformers_5_config_reads_the_same(preset, model_dir, tmp_path):
    """A config saved by transformers 5 (rope_parameters only) reads as the 4.x original."""
    src = model_dir(preset)
    saved = tmp_path / "saved"
    transformers.AutoConfig.from_pretrained(src).save_pretrained(saved)
    cfg = json.loads((saved / "config.json").read_text())
    assert "rope_parameters" in cfg and "rope_theta" not in cfg and "rope_scaling" not in cfg
    for f in src.iterdir():
        if f.name != "config.json":
            (saved / f.name).symlink_to(f)
    assert ModelConfig.from_dir(saved) == ModelConfig.from_dir(src)


def test_rope_layouts(model_dir, tmp_path):
    src = model_dir("tiny-mistral")
    legacy = _with_config(
        src, tmp_path / "a", rope_theta=2e5, rope_scaling={"type": "linear", "factor": 2.0}
    )
    cfg = ModelConfig.from_dir(legacy)
    assert (cfg.rope_theta, cfg.rope_scaling) == (2e5, RopeScaling("linear", factor=2.0))
    # rope_parameters wins where both are present; a null rope_theta is no value.
    both = _with_config(src, tmp_path / "b", rope_theta=None, rope_scaling=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 3e5})  # fmt: skip
    assert (ModelConfig.from_dir(both).rope_theta, ModelConfig.from_dir(both).rope_scaling) == (
        3e5,
        RopeScaling(),
    )
    nothing = _with_config(src, tmp_path / "c", rope_theta=None, rope_scaling=None)
    assert ModelConfig.from_dir(nothing).rope_theta == 10000.0
    for i, bad in enumerate([
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
        {"rope_parameters": {"full_attention": {"rope_theta": 1e4}}},
        {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    ]):  # fmt: skip
        with pytest.raises(ValueError, match="not supported"):
            ModelConfig.from_dir(_with_config(src, tmp_path / f"bad{i}", **bad))


def test_chat_template_jinja_and_named_templates(model_dir, tmp_path):
    src = model_dir("tiny-llama")
    saved = tmp_path / "saved"
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(saved)
    assert (saved / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    chat = [{"role": "user", "content": "hi"}]
    assert Tokenizer(saved).apply_chat_template(chat) == Tokenizer(src).apply_chat_template(chat)

    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer.json").symlink_to(src / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    (named / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(named).apply_chat_template(chat) == "D"


@pytest.mark.parametrize(
    ("saved", "served"),
    [
        ({"torch_dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": "float16"}, "float16"),  # transformers 5's key
        ({"torch_dtype": "float32"}, "float32"),
        ({"torch_dtype": "float64"}, "float32"),  # none we run: float32
        ({}, "float32"),
    ],
)
def test_auto_dtype_serves_the_checkpoints_own(tmp_path, model_dir, saved, served):
    from rtp_serve.core.dtypes import resolve_dtype
    from rtp_serve.engine import LLM

    path = _with_config(model_dir("tiny-llama"), tmp_path / "m", **({"torch_dtype": None} | saved))
    assert resolve_dtype("auto", path) == served
    assert resolve_dtype("bfloat16", path) == "bfloat16"  # an explicit dtype wins
    assert LLM(str(path), num_kv_blocks=4).engine.config.dtype == served
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int4", path)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_an_itl_target_is_a_finite_non_negative_number(bad):
    from rtp_serve.engine import EngineConfig

    assert EngineConfig(model="m", itl_target_ms=150).itl_target_ms == 150
    with pytest.raises(ValueError, match="itl_target_ms must be >= 0 and finite"):
        EngineConfig(model="m", itl_target_ms=bad)
