"""Token ids -> text, incrementally, with stop strings that never leak into the output.

A byte-level BPE can split one character over several tokens, so the text of a token is
not known until the character completes. The detokenizer decodes a small window of recent
tokens twice (vLLM/TGI's prefix/read offsets):

    ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                 '--- already emitted ---''--- new tokens ---'
    prefix_text = decode(ids[prefix:read])      new_text = decode(ids[prefix:])

and emits new_text[len(prefix_text):] only when it does not end in U+FFFD (an incomplete
character); then the window slides forward. Windows start at character boundaries, so the
pieces concatenate to decode(all ids).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from rtp_serve.core.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens; returns the text they complete (possibly "")."""
        self.ids.extend(ids)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """The end of the sequence: whatever is held back, incomplete characters included."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""


class StopStringMatcher:
    """Cuts a text stream at the first occurrence of any stop string.

    Text that could still be the start of a stop string is held back until it either
    completes one (cut there, the stop string itself is dropped) or stops matching.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Text safe to emit now; sets `stopped` when a stop string was completed."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            self.stopped = True
            return buf[: min(hits)]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The end of the stream: held text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest


class TextStream:
    """Detokenizer plus stop strings: what one generated sequence shows the client."""

    def __init__(
        self, tokenizer: Tokenizer, stops: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stops = StopStringMatcher(stops)

    @property
    def stopped(self) -> bool:
        """A stop string matched: the text is complete and later tokens must be dropped."""
        return self._stops.stopped

    def push(self, token_ids: Sequence[int]) -> str:
        return self._stops.push(self._detok.push(token_ids))

    def finish(self) -> str:
        """The rest of the text once the sequence has ended (stop strings still apply)."""
        text = self._stops.push(self._detok.flush())
        return text + self._stops.flush()


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, inverted (ByteLevel tokenizers)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """The text and raw bytes of single tokens, for logprobs (cached per id)."""

    def __init__(self, tokenizer: Tokenizer, byte_level: bool) -> None:
        self._tok = tokenizer
        self._byte_level = byte_level

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per process
    def text(self, token_id: int) -> str:
        """The token as text; a token holding part of a character is shown as its bytes,
        OpenAI's way ("bytes:\\xe6\\x97"), so distinct tokens stay distinct."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT in text:
            raw = bytes(self.bytes(token_id))
            try:
                raw.decode()
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def bytes(self, token_id: int) -> list[int]:
        piece = self._tok.id_to_token(token_id) if self._byte_level else None
        if piece is not None:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(self._tok.decode([token_id], skip_special_tokens=False).encode())
