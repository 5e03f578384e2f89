"""Tool calls in the Hermes format (Hermes-2-Pro, Qwen2.5, SmolLM2's ChatML): how a call is
written, parsed back out of a choice's output (whole or as it streams), and constrained.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One block may also hold a JSON list of such objects (SmolLM2's own prompt asks for that).
The parser splits the output text into content and calls:

    text ──push()──> OUTSIDE ──"<tool_call>"──> INSIDE ──"</tool_call>"──> OUTSIDE ...
                       │ content, less a tail       │ the call's JSON, buffered; valid:
                       │ that may start a tag       │ a call, else the block is content
                       v                            v
                 content deltas              ToolCallDelta(index, id, name, "") then
                                             ToolCallDelta(index, arguments=fragment)...

Whitespace next to a call is not content (the model writes newlines around its tags), so
a choice that only calls has content None. A block is a call only if it parses as JSON
with a known tool's name: anything else (malformed JSON, an unknown function, a block cut
off by max_tokens) stays content, so nothing the model wrote is lost.

Under `tool_choice` required or a named function the grammar (`grammar()`) guarantees the
calls parse; the parser then streams each call's arguments as they are generated
(`stream_arguments`), instead of holding the block until it closes.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The separators json.dumps writes, which is what Hermes-style training data shows.
_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The head of a call before its arguments, as the grammar writes it (name first).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a streamed call: the first has its id and name (arguments ""), the rest
    append to its arguments. `index` counts the choice's calls from 0."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
        function: dict[str, str] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        return out | {"function": function}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def render_call(name: str, arguments: Any) -> str:
    """One call as the model is shown it (assistant turns in the history) and writes it."""
    return (
        f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"
    )


def grammar(tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
    """llguidance's Lark grammar for one or more calls of `tools` ((name, parameters JSON
    schema) pairs): the output is nothing but Hermes blocks whose arguments match."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, params in tools
    ]
    schema = (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"x-guidance": _GUIDANCE}
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'start: call{repeat}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n'


@dataclass(slots=True)
class _Open:
    """The block being read: its text so far, and what was streamed of it."""

    text: str = ""
    id: str | None = None  # set once its head was streamed (stream_arguments)
    sent: int = 0  # characters of arguments streamed


@dataclass(slots=True)
class ToolCallParser:
    """Splits one choice's output, pushed in pieces, into content and tool calls."""

    names: frozenset[str]
    stream_arguments: bool = False
    # parallel_tool_calls false: calls past the first are dropped (the grammar of required /
    # a named function never lets the model write them; in auto it may).
    max_calls: int | None = None
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""  # text not yet decided
    _space: str = ""  # content whitespace held back: dropped if a call follows
    _after_call: bool = False  # whitespace right after a call is dropped too
    _open: _Open | None = None

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New content and call deltas for `text`, appended to the output."""
        self._buf += text
        content, deltas = "", []
        while True:
            if self._open is None:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_tag(self._buf)
                    content += self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return content, deltas
                content += self._content(self._buf[:at])
                self._buf, self._open = self._buf[at + len(OPEN) :], _Open()
            block = self._open
            block.text, self._buf = block.text + self._buf, ""
            end = block.text.find(CLOSE)
            if end < 0:
                if self.stream_arguments:
                    deltas += self._stream(block)
                return content, deltas
            block.text, self._buf = block.text[:end], block.text[end + len(CLOSE) :]
            c, d = self._close(closed=True)
            content, deltas = content + c, deltas + d

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest, at the end of the output: an unclosed block is a call only if it parses
        (or was streamed already); held whitespace is content unless there were calls."""
        content, deltas = "", []
        if self._open is not None:
            content, deltas = self._close(closed=False)
        content += self._content(self._buf)
        self._buf = ""
        if not self.calls:
            content, self._space = content + self._space, ""
        return content, deltas

    def _content(self, text: str) -> str:
        """Content to send now: trailing whitespace waits to see what follows it."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if not text:
            return ""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        return body

    def _close(self, closed: bool) -> tuple[str, list[ToolCallDelta]]:
        block, self._open = self._open, None
        assert block is not None
        if block.id is not None:  # streamed: committed to this call, whatever follows
            arguments = _arguments(block.text)
            index = len(self.calls)
            self.calls.append(ToolCall(block.id, _head_name(block.text) or "", arguments))
            self._after_call = True
            rest = arguments[block.sent :]
            return "", [ToolCallDelta(index, arguments=rest)] if rest else []
        parsed = self._parse(block.text)
        if parsed is None:
            raw = OPEN + block.text + (CLOSE if closed else "")
            return self._content(raw), []
        self._space, self._after_call = "", True
        deltas = []
        for name, arguments in parsed:
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                break
            index = len(self.calls)
            self.calls.append(ToolCall(new_call_id(), name, arguments))
            deltas += [
                ToolCallDelta(index, self.calls[-1].id, name),
                ToolCallDelta(index, arguments=arguments),
            ]
        return "", deltas

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call in a block; None if it is not calls."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        items = value if isinstance(value, list) and value else [value]
        out = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in self.names:
                return None
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            # The model's own text of the arguments when it wrote the usual shape, so a
            # streamed call and a whole one carry the same string.
            raw = _arguments(text) if len(items) == 1 and _HEAD.match(text) else None
            out.append((item["name"], raw or json.dumps(args, ensure_ascii=False)))
        return out

    def _stream(self, block: _Open) -> list[ToolCallDelta]:
        """Deltas for what a block grew by: its head once the name is known, then the
        arguments (an object) as far as they go."""
        deltas = []
        if block.id is None:
            name = _head_name(block.text)
            if name not in self.names:
                return []
            self._space = ""
            block.id = new_call_id()
            deltas.append(ToolCallDelta(len(self.calls), block.id, name))
        arguments = _arguments(block.text)
        if len(arguments) > block.sent:
            deltas.append(ToolCallDelta(len(self.calls), arguments=arguments[block.sent :]))
            block.sent = len(arguments)
        return deltas


def _partial_tag(text: str) -> int:
    """Length of the longest tail of `text` that could begin OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _head_name(text: str) -> str | None:
    """The function name in a call's head; None before it is complete."""
    head = _HEAD.match(text)
    if head is None:
        return None
    try:
        return json.loads(f'"{head.group(1)}"')
    except ValueError:
        return None


def _arguments(text: str) -> str:
    """The arguments object's text in a call's JSON, as far as it goes: up to its closing
    brace once written. "" when the head is not there, or the value is not an object."""
    head = _HEAD.match(text)
    if head is None or not text.startswith("{", head.end()):
        return ""
    start = head.end()
    return text[start : start + _object_length(text[start:])]


def _object_length(text: str) -> int:
    """Characters of the JSON object `text` starts with: all of `text` while it is open."""
    depth, in_string, escaped = 0, False, False
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def parse_all(names: Iterable[str], text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when empty) and calls."""
    parser = ToolCallParser(frozenset(names))
    content, _ = parser.push(text)
    rest, _ = parser.finish()
    return (content + rest) or None, parser.calls
