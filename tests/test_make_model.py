"""The generated checkpoints are byte-deterministic and load in HF transformers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rtp_serve.models import make_model

transformers = pytest.importorskip("transformers")

TINY = ["tiny-llama", "tiny-qwen2", "tiny-mistral"]


def _digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_model.build_model(name, root / name) for name in TINY}


@pytest.mark.parametrize("name", TINY)
def test_build_is_byte_identical(name: str, built: dict[str, Path], tmp_path: Path) -> None:
    again = make_model.build_model(name, tmp_path / "again")
    assert _digests(again) == _digests(built[name])
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(_digests(again))
    assert not list(tmp_path.glob(".*")), "temp dirs left behind"


@pytest.mark.parametrize("name", TINY)
def test_hf_loads_config_model_and_tokenizer(name: str, built: dict[str, Path]) -> None:
    d, preset = built[name], make_model.PRESETS[name]
    config = transformers.AutoConfig.from_pretrained(d)
    assert config.model_type == preset.model_type
    assert config.architectures == [preset.architecture]
    assert config.vocab_size == make_model.VOCAB_SIZE

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(model).__name__ == preset.architecture
    state = model.state_dict()
    for key, t in _tensors(d).items():
        assert torch.equal(state[key], t), key
    if preset.tie_word_embeddings:
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])

    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert len(tok) == config.vocab_size
    assert tok.convert_tokens_to_ids(list(make_model.SPECIAL_TOKENS)) == [0, 1, 2]
    assert tok.eos_token_id == config.eos_token_id == 0
    chat = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert ids == tok(text)["input_ids"] and ids[0] == 1 and ids.count(2) == 1


@pytest.mark.parametrize("name", TINY)
def test_tokenizer_round_trip_matches_hf(name: str, built: dict[str, Path]) -> None:
    from tokenizers import Tokenizer

    text = "héllo 世界 🙂\n\tdef f(): pass  <|im_start|>x<|im_end|>\n  1234 "
    raw = Tokenizer.from_file(str(built[name] / "tokenizer.json"))
    ids = raw.encode(text).ids
    assert raw.decode(ids, skip_special_tokens=False) == text
    # HF rebuilds some tokenizers (Qwen2) from vocab + merges: it must tokenize the same.
    hf = transformers.AutoTokenizer.from_pretrained(built[name])
    assert hf(text)["input_ids"] == ids
    assert hf.decode(ids) == text


def test_greedy_generation_is_varied(built: dict[str, Path]) -> None:
    torch.manual_seed(0)
    for name in TINY:
        d = built[name]
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        tok = transformers.AutoTokenizer.from_pretrained(d)
        ids = tok("def main():\n", return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
        new = out[0, ids.shape[1] :].tolist()
        assert len(set(new)) >= 12, (name, new)


def test_sharded_build_matches_unsharded(built: dict[str, Path], tmp_path: Path) -> None:
    d = make_model.build_model("tiny-llama", tmp_path / "sharded", max_shard_bytes=2 << 20)
    shards = sorted(f.name for f in d.glob("*.safetensors"))
    n = len(shards)
    assert n > 2 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    whole = _tensors(built["tiny-llama"])
    assert set(index["weight_map"]) == set(whole)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in whole.values())
    for shard in shards:
        for key, t in load_file(d / shard).items():
            assert index["weight_map"][key] == shard
            assert torch.equal(t, whole[key])

    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[k], t) for k, t in whole.items())


def test_unknown_preset_raises() -> None:
    with pytest.raises(ValueError, match="tiny-llama"):
        make_model.build_model("gpt-17", "/nonexistent/never-written")
    with pytest.raises(ValueError, match="valid"):
        make_model.ensure_model("gpt-17")


def test_ensure_model_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RTP_SERVE_MODEL_CACHE", str(tmp_path / "cache"))
    assert make_model.model_cache_dir() == tmp_path / "cache"
    first = make_model.ensure_model("tiny-mistral")
    assert first.parent == tmp_path / "cache" and (first / "config.json").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert make_model.ensure_model("tiny-mistral") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_resolve_model(built: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RTP_SERVE_MODEL_CACHE", str(tmp_path / "cache"))
    d = built["tiny-qwen2"]
    assert make_model.resolve_model(str(d)) == d
    assert make_model.resolve_model("tiny-mistral") == tmp_path / "cache" / "tiny-mistral-v1"
    with pytest.raises(ValueError, match="neither a model directory nor a preset"):
        make_model.resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="smollm2-135m"):
        make_model.ensure_model("gpt-17")
    with pytest.raises(ValueError, match="--from and --dtype"):
        make_model.build_model("tiny-llama", tmp_path / "x", dtype="bfloat16")


def test_resolving_a_cached_model_imports_no_torch(tmp_path: Path, monkeypatch) -> None:
    # The launcher resolves the model before it starts anything: torch (2 s of imports on
    # these machines) there would delay every `rtp-serve up`.
    monkeypatch.setenv("RTP_SERVE_MODEL_CACHE", str(tmp_path / "cache"))
    cached = make_model.ensure_model("tiny-llama")
    code = (
        "import sys, rtp_serve.services.launcher.main; from rtp_serve.models.make_model import resolve_model; "
        f"assert resolve_model('tiny-llama') == resolve_model({str(cached)!r}); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
