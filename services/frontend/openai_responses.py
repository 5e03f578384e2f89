"""OpenAI response objects and stream chunks, for /v1/completions and /v1/chat/completions.

Both endpoints share the choice bookkeeping (`Choice`); they differ only in shape:
completions carry `text` and the legacy logprobs arrays, chat carries `message`/`delta` and
`logprobs.content` entries with token bytes.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from rtp_serve.services.common.pb import common_pb2
from rtp_serve.services.frontend.detokenizer import TokenText
from rtp_serve.services.frontend.generation import Delta
from rtp_serve.services.frontend.tool_calls import ToolCallDelta, ToolCallParser

Json = dict[str, Any]


@dataclass(slots=True)
class Choice:
    """Everything one choice has produced so far (non-streaming responses and usage)."""

    text: str = ""
    finish_reason: str | None = None
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Chat with tools: reads the output for calls (the text left is the content).
    parser: ToolCallParser | None = None

    def add(self, delta: Delta) -> tuple[Delta, list[ToolCallDelta]]:
        """Take in a sequence's delta; returns it as the client sees it (tool calls out of
        its text, finish_reason `tool_calls` when the model stopped after calling) and the
        tool-call deltas it made."""
        calls: list[ToolCallDelta] = []
        if self.parser is not None:
            text, calls = self.parser.push(delta.text)
            finish = delta.finish_reason
            if finish is not None:
                rest, more = self.parser.finish()
                text, calls = text + rest, calls + more
                if self.parser.calls and finish == "stop":
                    finish = "tool_calls"
            delta = replace(delta, text=text, finish_reason=finish)
        self.text += delta.text
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.prompt_tokens = delta.prompt_tokens
        self.completion_tokens = delta.completion_tokens
        self.cached_tokens = delta.cached_tokens
        return delta, calls


def best(choices: list[Choice], n: int) -> list[Choice]:
    """`best_of`: the `n` candidates with the highest log probability per token (OpenAI's
    rule), in their original order among themselves."""
    if len(choices) <= n:
        return choices

    def mean_logprob(i: int) -> float:
        lps = choices[i].logprobs
        return sum(lp.logprob for lp in lps) / len(lps) if lps else float("-inf")

    ranked = sorted(range(len(choices)), key=lambda i: (-mean_logprob(i), i))[:n]
    return [choices[i] for i in sorted(ranked)]


def usage(choices: list[Choice]) -> Json:
    prompt = max((c.prompt_tokens for c in choices), default=0)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": max(c.cached_tokens for c in choices)},
    }


class ResponseBuilder:
    """Builds the objects of one response: same id, creation time and model throughout."""

    def __init__(
        self,
        chat: bool,
        model: str,
        token_text: TokenText,
        logprobs: bool,
        request_id: str | None = None,
    ) -> None:
        """`request_id`: the id the client chose, else a fresh one."""
        self.chat = chat
        self.id = request_id or ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self._tt = token_text
        self._logprobs = logprobs
        self._offsets: dict[int, int] = {}  # completions: text_offset so far, per choice

    def _head(self, obj: str) -> Json:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[Choice], generated: list[Choice] | None = None) -> Json:
        """`generated`: every sequence the usage counts, when more than `choices` (best_of)."""
        out = self._head("chat.completion" if self.chat else "text_completion")
        out["choices"] = [self._choice(i, c) for i, c in enumerate(choices)]
        out["usage"] = usage(generated or choices)
        return out

    def _choice(self, index: int, c: Choice) -> Json:
        logprobs = self.format_logprobs(index, c.logprobs)
        if self.chat:
            message: Json = {"role": "assistant", "content": c.text}
            if c.parser is not None and c.parser.calls:
                message["content"] = c.text or None
                message["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in c.parser.calls
                ]
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }
        return {
            "index": index,
            "text": c.text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
        }

    def chunk(
        self,
        index: int,
        delta: Delta | None,
        include_usage: bool,
        role: bool = False,
        tool_calls: list[ToolCallDelta] | None = None,
        tools: bool = False,
    ) -> Json:
        """A stream chunk for one choice; `role` (chat): the opening chunk with the role,
        its content null when the choice may turn out to be tool calls (as OpenAI's)."""
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        text = delta.text if delta is not None else ""
        finish = delta.finish_reason if delta is not None else None
        logprobs = self.format_logprobs(index, delta.logprobs) if delta is not None else None
        if self.chat:
            body: Json = {"role": "assistant", "content": None if tools else ""} if role else {}
            if text:
                body["content"] = text
            if tool_calls:
                body["tool_calls"] = [d.to_json() for d in tool_calls]
            choice = {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        out["choices"] = [choice]
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, choices: list[Choice]) -> Json:
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage(choices)
        return out

    # -- logprobs --------------------------------------------------------------------------
    def format_logprobs(self, index: int, lps: list[common_pb2.TokenLogprob]) -> Json | None:
        if not self._logprobs:
            return None
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in lps]}
        offset = self._offsets.get(index, 0)
        tokens, offsets = [], []
        for lp in lps:
            tokens.append(self._tt.text(lp.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in lps],
            "top_logprobs": [self._top_dict(lp) for lp in lps],
            "text_offset": offsets,
        }

    def _top_dict(self, lp: common_pb2.TokenLogprob) -> dict[str, float]:
        top = {self._tt.text(t.token_id): _finite(t.logprob) for t in lp.top}
        top.setdefault(self._tt.text(lp.token_id), _finite(lp.logprob))  # the sampled one, always
        return top

    def _chat_entry(self, lp: common_pb2.TokenLogprob) -> Json:
        return {
            "token": self._tt.text(lp.token_id),
            "logprob": _finite(lp.logprob),
            "bytes": self._tt.bytes(lp.token_id),
            "top_logprobs": [
                {
                    "token": self._tt.text(t.token_id),
                    "logprob": _finite(t.logprob),
                    "bytes": self._tt.bytes(t.token_id),
                }
                for t in lp.top
            ],
        }


def _finite(logprob: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return max(logprob, -9999.0) if not math.isnan(logprob) else -9999.0
