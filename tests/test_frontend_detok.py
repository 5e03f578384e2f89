"""Incremental detokenization and stop strings, with the real byte-level BPE tokenizer.

The tiny model's tokenizer splits most non-ASCII characters over several tokens, so these
texts exercise every way a character can straddle token boundaries.
"""

from __future__ import annotations

import random

import pytest

from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.services.frontend.detokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    TextStream,
    TokenText,
)

TEXTS = [
    "héllo wörld 🙂 日本語のテキスト",
    "naïve café — ñandú 😀👍🏽 中文字符 and ascii",
    "Ελληνικά κείμενο, русский текст, עברית",
    "emoji at the end 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # ∑ ∫ √ ≠\n",
    "🎉🎉🎉",
]


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir("tiny-llama"))


def stream(tok: Tokenizer, ids: list[int], stops=(), chunks: list[int] | None = None):
    """Pieces emitted when `ids` arrive in `chunks` (token counts; default one at a time)."""
    ts = TextStream(tok, stops)
    pieces, i = [], 0
    for n in chunks or [1] * len(ids):
        pieces.append(ts.push(ids[i : i + n]))
        i += n
        if ts.stopped:
            break
    if not ts.stopped:
        pieces.append(ts.finish())
    return pieces, ts.stopped


def test_texts_split_characters_across_tokens(tok: Tokenizer) -> None:
    # Guard: the tests below are only meaningful if single tokens hold partial characters.
    split = [t for t in TEXTS if any("\ufffd" in tok.decode([i]) for i in tok.encode(t))]
    assert len(split) == len(TEXTS)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces, stopped = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not stopped
    assert not any("\ufffd" in p for p in pieces), pieces  # nothing half-decoded leaks
    rng = random.Random(len(text))
    for _ in range(20):  # tokens arriving several at a time (PD first message, speculation)
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        assert "".join(stream(tok, ids, chunks=chunks)[0]) == text


def test_special_tokens_are_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("ab 🙂") + [2] + tok.encode(" cd")  # 2 = <|im_end|>
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids) == "ab 🙂 cd"


def test_incomplete_character_is_flushed_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("x🙂")
    cut = ids[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok)
    held = "".join(detok.push([i]) for i in cut)
    assert held == "x"
    assert held + detok.flush() == tok.decode(cut)


@pytest.mark.parametrize("text", TEXTS)
def test_every_stop_string_is_cut_exactly(tok: Tokenizer, text: str) -> None:
    """Every substring of length 1..4 as a stop string: the output is the text before its
    first occurrence, however the stop string straddles token boundaries."""
    ids = tok.encode(text)
    for length in range(1, 5):
        for start in range(len(text) - length + 1):
            stop = text[start : start + length]
            pieces, stopped = stream(tok, ids, [stop])
            assert stopped, stop
            assert "".join(pieces) == text[: text.find(stop)], stop


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    text = "one two three four"
    pieces, stopped = stream(tok, tok.encode(text), ["four", "two", "e t"])
    assert stopped and "".join(pieces) == "on"


def test_partial_stop_string_is_held_then_released(tok: Tokenizer) -> None:
    text = "the end is nigh"
    ids = tok.encode(text)
    pieces, stopped = stream(tok, ids, ["nighty"])
    assert not stopped and "".join(pieces) == text
    assert pieces[-1].endswith("nigh")  # held back until the stream finished


def test_stop_matcher_holds_only_possible_prefixes() -> None:
    m = StopStringMatcher(["abc", "xyz"])
    assert m.push("hello a") == "hello "
    assert m.push("b") == ""
    assert m.push("d") == "abd"
    assert m.push("xy") == ""
    assert m.push("zzz") == "" and m.stopped
    assert m.flush() == ""
    assert StopStringMatcher([]).push("anything") == "anything"
    assert StopStringMatcher([""]).push("empty stop strings are ignored") != ""


def test_token_bytes_reassemble_the_text(tok: Tokenizer) -> None:
    tt = TokenText(tok, byte_level=True)
    for text in TEXTS:
        ids = tok.encode(text)
        assert bytes(b for i in ids for b in tt.bytes(i)) == text.encode()
    assert tt.bytes(2) == list(b"<|im_end|>")
    assert tt.text(2) == "<|im_end|>"
    e_acute = tok.encode("é")
    assert [tt.text(i) for i in e_acute] == ["bytes:\\xc3", "bytes:\\xa9"]
