"""Small synthetic GGUF files, written with `gguf.GGUFWriter` as llama.cpp's convert script
would write them: HF weights (kept, for comparison) -> q/k permuted (Llama) -> quantized.

Tiny shapes (hidden 64, 2 layers) keep each file a few hundred KB, so the conversion tests
run in seconds; every block-quantized row is a multiple of 32 values, as GGUF requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
CONTEXT = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Byte-level BPE merges (GPT-2's byte alphabet: Ġ is a space); each makes a vocabulary token.
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "1 2"]


@dataclass(frozen=True, slots=True)
class Synthetic:
    path: Path
    arch: str
    weights: dict[str, np.ndarray]  # the HF weights (float32) before permutation and quantization
    tied: bool


def byte_level_vocab() -> list[str]:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = [m.replace(" ", "") for m in MERGES]
    return SPECIALS + alphabet + merged


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of a small sentencepiece BPE vocabulary with byte fallback."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, CONTROL, BYTE...
    pieces = ["▁", "t", "h", "e", "a", "n", "d", "i", "o", "s", "w", "r", "l", "c",
              "he", "▁t", "▁the", "an", "▁an", "▁and", "in", "▁a", "▁w", "or", "▁wor", "ld",
              "▁world", "ll", "▁hell", "▁hello", "el", "▁he"]  # fmt: skip
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return tokens + pieces, scores, types + [1] * len(pieces)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF rotate_half -> GGUF pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_weights(arch: str, vocab: int, tied: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.25) -> np.ndarray:
        return rng.normal(0.0, std, shape).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(vocab, HIDDEN, std=1.0)}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + normal(HIDDEN, std=0.1)
        w[p + "self_attn.q_proj.weight"] = normal(q, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = normal(kv, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = normal(kv, HIDDEN)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal(q, std=0.1)
            w[p + "self_attn.k_proj.bias"] = normal(kv, std=0.1)
            w[p + "self_attn.v_proj.bias"] = normal(kv, std=0.1)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, q)
        w[p + "post_attention_layernorm.weight"] = 1.0 + normal(HIDDEN, std=0.1)
        w[p + "mlp.gate_proj.weight"] = normal(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = normal(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, FFN, std=0.1)
    w["model.norm.weight"] = 1.0 + normal(HIDDEN, std=0.1)
    if not tied:
        w["lm_head.weight"] = normal(vocab, HIDDEN)
    return w


_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    base, kind = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, module = base.split(".", 3)
        return f"blk.{i}.{_TO_GGUF[module]}.{kind}"
    return f"{_TO_GGUF[base]}.{kind}"


def write_gguf(
    path: Path,
    qtype: str = "F32",
    *,
    arch: str = "llama",
    tokenizer: str = "gpt2",
    tied: bool = True,
    seed: int = 0,
) -> Synthetic:
    """A GGUF of a tiny model: 2-D weights in ``qtype``, norms and biases in F32."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("synthetic")
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if tokenizer == "gpt2":
        tokens = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    else:
        tokens, scores, types = sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    w.add_vocab_size(len(tokens))
    weights = _hf_weights(arch, len(tokens), tied, seed)
    qt = gguf.GGMLQuantizationType[qtype]
    for name, value in weights.items():
        data = value
        if arch == "llama" and "q_proj.weight" in name:
            data = permute_qk(data, HEADS)
        elif arch == "llama" and "k_proj.weight" in name:
            data = permute_qk(data, KV_HEADS)
        if data.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Synthetic(path, arch, weights, tied)
