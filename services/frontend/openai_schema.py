"""OpenAI request bodies -> typed requests, with a 400 naming the parameter for anything wrong.

Only JSON shapes and OpenAI semantics live here (which field means what, per endpoint);
limits that depend on the model or the prompt are checked in generation.prepare.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.frontend.errors import invalid
from services.frontend.inputs import Options

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    options: Options
    stream: bool
    include_usage: bool


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]  # {"role", "content"}, content flattened to text
    options: Options  # options.logprobs: top_logprobs when logprobs were asked for
    stream: bool
    include_usage: bool


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8: {exc}") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("prompt is required", "prompt")
    for unsupported in ("suffix", "echo"):
        if body.get(unsupported):
            raise invalid(f"{unsupported} is not supported", unsupported)
    logprobs = _int(body, "logprobs", None)
    stream, include_usage = _stream(body)
    return CompletionRequest(
        model=_model(body),
        prompt=_prompt(body["prompt"]),
        options=_options(body, _int(body, "max_tokens", None), logprobs),
        stream=stream,
        include_usage=include_usage,
    )


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of messages", "messages")
    if body.get("tools"):
        raise invalid("tools are not supported", "tools")
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None and not want_logprobs:
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)
    stream, include_usage = _stream(body)
    return ChatRequest(
        model=_model(body),
        messages=[_message(i, m) for i, m in enumerate(messages)],
        options=_options(body, max_tokens, (top or 0) if want_logprobs else None),
        stream=stream,
        include_usage=include_usage,
    )


# -- pieces --------------------------------------------------------------------------------
def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (a string)", "model")
    return model


def _prompt(value: Any) -> str | list[int]:
    """A string, a list of token ids, or a list holding one of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if value and all(isinstance(v, str) for v in value):
            raise invalid("only one prompt per request is supported", "prompt")
        if all(_is_int(v) for v in value):
            return list(value)
        if all(isinstance(v, list) for v in value):
            raise invalid("only one prompt per request is supported", "prompt")
    raise invalid("prompt must be a string or a list of token ids", "prompt")


def _message(i: int, message: Any) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise invalid(f"{param} must be an object", param)
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise invalid(f"{param}.role must be a non-empty string", f"{param}.role")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(f"{param}.content: only text parts are supported", f"{param}.content")
            if not isinstance(part.get("text"), str):
                raise invalid(f"{param}.content: a text part needs text", f"{param}.content")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise invalid(f"{param}.content must be a string or a list of parts", f"{param}.content")
    return {"role": role, "content": content}


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    return stream, _bool(options, "include_usage", False, "stream_options.include_usage")


def _options(body: dict[str, Any], max_tokens: int | None, logprobs: int | None) -> Options:
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise invalid(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        stops = tuple(stop)
    else:
        raise invalid("stop must be a string or a list of strings", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise invalid("stop_token_ids must be a list of integers", "stop_token_ids")
    session = body.get("session_id") or body.get("user") or ""
    if not isinstance(session, str):
        raise invalid("session_id must be a string", "session_id")
    return Options(
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0),
        top_p=_float(body, "top_p", 1.0),
        top_k=_int(body, "top_k", -1),
        seed=_int(body, "seed", None),
        stop=stops,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(body, "ignore_eos", False),
        min_tokens=_int(body, "min_tokens", 0),
        logprobs=logprobs,
        n=_int(body, "n", 1),
        session_id=session,
        priority=_int(body, "priority", 0),
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise invalid(f"{name} must be an integer, got {value!r}", name)
    return value


def _float(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{param or name} must be a boolean, got {value!r}", param or name)
    return value
