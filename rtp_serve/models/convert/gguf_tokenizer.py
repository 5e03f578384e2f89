"""tokenizer.json and tokenizer_config.json from a GGUF file's tokenizer metadata.

A GGUF carries the vocabulary (`tokenizer.ggml.tokens`, with a type per token), the BPE
merges (byte-level vocabularies) or scores (sentencepiece ones), the special token ids and
`tokenizer.ggml.pre`, llama.cpp's name for how text is split before BPE. This module
rebuilds the HF `tokenizers` pipeline those describe, so HF's `PreTrainedTokenizerFast` and
`rtp_serve/core/tokenizer.py` tokenize exactly as the original checkpoint did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from rtp_serve.models.convert.gguf_file import GGUFError, GGUFModel

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its vocabulary was trained with (llama-vocab.cpp).
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
# GPT-2's own regex after splitting off every digit (StarCoder's tokenizer, SmolLM's).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
_GPT2 = ("gpt2", "gpt-2", "default")
_NFC = ("qwen2", "deepseek-r1-qwen")  # HF's Qwen2 tokenizer.json normalizes to NFC
_IGNORE_MERGES = ("llama-bpe", "llama3")  # whole-word vocabulary hits skip BPE (Llama 3)


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    special_tokens_map: dict[str, str]
    chat_template: str | None


def build_tokenizer(model: GGUFModel) -> TokenizerFiles:
    kind = model.field("tokenizer.ggml.model")
    tokens: list[str] = model.field("tokenizer.ggml.tokens") or []
    if not tokens:
        raise GGUFError(f"{model.path}: no tokenizer in the file (tokenizer.ggml.tokens)")
    types: list[int] = model.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok, add_bos = _byte_level(model, tokens), bool(model.field("tokenizer.ggml.add_bos_token"))
    elif kind == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        tok, add_bos = (
            _sentencepiece(model, tokens),
            model.field("tokenizer.ggml.add_bos_token", True),
        )
    else:
        raise GGUFError(f"{model.path}: tokenizer model {kind!r} is not supported (gpt2, llama)")

    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    specials = [i for i, t in enumerate(types) if t == _CONTROL]
    added = [i for i, t in enumerate(types) if t == _USER_DEFINED]
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in specials]
    )
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in added])

    named = _named_special_tokens(model, tokens)
    if add_bos and "bos_token" in named:
        bos, bos_id = named["bos_token"], model.field("tokenizer.ggml.bos_token_id")
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
        if kind == "gpt2":
            template = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
        tok.post_processor = template
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    decoder = {
        str(i): {"content": tokens[i], "special": types[i] == _CONTROL} | flags
        for i in sorted(specials + added)
    }
    context = model.field(f"{model.arch}.context_length")
    config: dict[str, Any] = named | {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(model.field("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context) if context else 2048,
    }
    extra = [tokens[i] for i in specials if tokens[i] not in named.values()]
    if extra:
        config["additional_special_tokens"] = extra
    template = model.field("tokenizer.chat_template")
    return TokenizerFiles(tok.to_str(pretty=True), config, named, template)


def _named_special_tokens(model: GGUFModel, tokens: list[str]) -> dict[str, str]:
    out = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = model.field(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            out[f"{name}_token"] = tokens[token_id]
    return out


def _byte_level(model: GGUFModel, tokens: list[str]) -> Tokenizer:
    merges_text: list[str] = model.field("tokenizer.ggml.merges") or []
    merges = []
    for m in merges_text:
        cut = m.find(" ", 1)  # as llama.cpp splits them: a part may itself start with a space
        merges.append((m[:cut], m[cut + 1 :]))
    split = model.field("tokenizer.ggml.pre", "default")
    bpe = models.BPE(
        vocab={t: i for i, t in reversed(list(enumerate(tokens)))},  # first id wins on repeats
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=split in _IGNORE_MERGES,
    )
    tok = Tokenizer(bpe)
    if split in _SPLITS:
        tok.pre_tokenizer = pre.Sequence(
            [
                pre.Split(Regex(_SPLITS[split]), behavior="isolated"),
                pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif split in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre.Sequence(
            [pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)]
        )
    elif split in _GPT2:
        tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    else:
        raise GGUFError(f"{model.path}: pre-tokenizer {split!r} (tokenizer.ggml.pre) is unknown")
    if split in _NFC:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(model: GGUFModel, tokens: list[str]) -> Tokenizer:
    """A sentencepiece BPE vocabulary as HF's LlamaTokenizer builds it (byte fallback).

    The file has scores, not merges: a merge is every split of a vocabulary piece into two
    pieces that are themselves in the vocabulary, ranked by the merged piece's score (what
    transformers' `generate_merges` does for sentencepiece models).
    """
    scores: list[float] = model.field("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    ranked = []
    for piece, score in zip(tokens, scores, strict=True):
        local = [
            (piece[:k], piece[k:])
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked += [(score, left, right) for left, right in local]
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    unk_id = model.field("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for _, left, right in ranked],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(model.field("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok
