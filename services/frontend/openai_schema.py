"""The OpenAI request bodies as typed models (pydantic v2): one definition per request type,
from which requests are validated and `GET /openapi.json` is built.

Only JSON shapes and OpenAI semantics live here (which field means what, per endpoint);
limits that depend on the model or the prompt are checked in inputs.prepare. Any error is
a 400 naming the parameter. A field this server does not know is refused by name, and so
is a known OpenAI field it does not implement, unless it is given its no-op value
(`presence_penalty: 0`, `response_format: {"type": "text"}`, ...).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from rtp_serve.core.sampling_params import MAX_SPECULATIVE_TOKENS
from rtp_serve.core.structured import StructuredOutputs
from rtp_serve.core.validation import InvalidRequestError
from rtp_serve.services.frontend.errors import FrontendError, invalid
from rtp_serve.services.frontend.inputs import Options
from rtp_serve.services.frontend.tool_calls import ToolCallParser
from rtp_serve.services.frontend.tool_calls import grammar as tool_grammar

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOKEN_ID_DIGITS = 10  # a token id is a uint32 on the wire

Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
# What the wire (int32 protobuf fields) can carry: larger is a 400 naming the field.
Int32 = Annotated[int, Field(ge=-(1 << 31), le=(1 << 31) - 1)]
# Longer is not a deadline any more (and past ~5e9 s gRPC reads it as already passed).
MAX_TIMEOUT_S = 1e6
Timeout = Annotated[
    float,
    Field(
        gt=0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="Seconds this request may take, from its arrival (an extension). Still "
        "queued when it passes (no output yet): a 504 error naming `timeout`. Passing while "
        "generating: the output so far, finish_reason `length`. Every worker on the request's "
        "path gives up at the same deadline and frees what it held.",
    ),
]


class _Strict(BaseModel):
    # strict: "8" is not an integer and 1 is not true; forbid: unknown fields are refused.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class FunctionCall(_Strict):
    name: Annotated[str, Field(min_length=1)]
    arguments: str = Field(description="The arguments as JSON text (an object)")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"arguments must be a JSON object: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object")
        return value


class ToolCallParam(_Strict):
    """A call in an assistant message of the history, as the API returned it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Annotated[str, Field(min_length=1)]
    # A string, or content parts (text only), flattened to one string.
    content: str = ""
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of

    @field_validator("content", mode="before")
    @classmethod
    def _flatten(cls, value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError("content: only text parts are supported")
                if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise ValueError("content: a text part is {'type': 'text', 'text': str}")
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("content must be a string or a list of parts")


JsonSchemaObject = Annotated[
    dict[str, Any], Field(description="A JSON schema (draft 2020-12 subset, as llguidance takes)")
]


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: OpenAI's structured outputs."""

    model_config = ConfigDict(populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: JsonSchemaObject = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(
        None, description="Accepted either way: every output is made to match the schema"
    )


class ResponseFormat(_Strict):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema is required with type json_schema only")
        return self


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    model_config = ConfigDict(populate_by_name=True)
    json_: JsonSchemaObject | str | None = Field(
        None, alias="json", description="A JSON schema (an object, or its JSON text)"
    )
    json_object: bool | None = Field(None, description="true: any JSON object")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, description="A Lark (llguidance dialect) or GBNF grammar")


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: JsonSchemaObject | None = Field(
        None, description="The arguments' JSON schema (default: any object)"
    )
    strict: bool | None = Field(
        None,
        description="Accepted either way: under tool_choice required or a named "
        "function the arguments always match `parameters`",
    )


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """`tool_choice` naming the one function to call."""

    type: Literal["function"]
    function: ToolChoiceFunction


class _GenerationRequest(_Strict):
    """What both endpoints take."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    # Extensions shared with vLLM.
    top_k: Int32 = -1
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: Int32 = 0  # lower runs first
    session_id: str | None = None  # affinity key for routing (default: `user`)
    timeout: Timeout | None = None
    # Speculative decoding, where the workers run it (--speculative): this request's drafts
    # per step at most (0: off; absent: the workers' setting), and a text the output is
    # expected to repeat, such as the file being edited (RTP-LLM's sp_advice_prompt).
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    speculative_advice: str | None = None
    # Structured outputs (rtp_serve/core/structured.py): at most one of these per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: JsonSchemaObject | str | None = Field(
        None, description="vLLM's older extra: a JSON schema (an object, or its JSON text)"
    )
    guided_regex: str | None = Field(None, description="vLLM's older extra: a regex")
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="vLLM's older extra: the output is one of these strings"
    )
    guided_grammar: str | None = Field(
        None, description="vLLM's older extra: a Lark (llguidance dialect) or GBNF grammar"
    )
    # Logits processing (engine/logits_processors.py), as vLLM: presence and frequency
    # count the output, repetition the prompt and the output.
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        1.0, description="vLLM's extra: > 1 discourages any token of the prompt or output"
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit, in [-100, 100]"
    )
    # OpenAI fields the client may send that change nothing here: accepted and ignored.
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    _spec: StructuredOutputs | None = PrivateAttr(None)

    # OpenAI fields not implemented: allowed only with their no-op value (see _check).
    NO_OP: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            # ASCII digits only ("²".isdigit() is true, and int() refuses it), and few enough
            # that int() takes them; the vocabulary bound is checked in inputs.prepare.
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"logit_bias keys must be token ids, got {key[:40]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        return value  # how many, and how long: limits.py (a frontend flag)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check(self) -> None:
        """Rules across fields, and unsupported fields set to something that does anything."""
        for name, no_ops in self.NO_OP.items():
            value = getattr(self, name)
            if value is not None and value not in no_ops:
                raise invalid(f"{name} is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        self._spec = self._structured()  # validated here, once

    def _structured(self) -> StructuredOutputs | None:
        """The request's one constraint on its output, validated (400 naming the field)."""
        asked = [(param, spec) for param, spec in self._structured_fields() if spec is not None]
        if not asked:
            return None
        if len(asked) > 1:
            raise invalid(
                f"{asked[1][0]}: only one structured output constraint per request "
                f"({asked[0][0]} is set too)",
                asked[1][0],
            )
        param, spec = asked[0]
        try:
            spec.validate(param)
        except InvalidRequestError as exc:
            raise invalid(str(exc), exc.param) from None
        return spec

    def _structured_fields(self) -> list[tuple[str, StructuredOutputs | None]]:
        fields: list[tuple[str, StructuredOutputs | None]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            fields.append(("response_format", StructuredOutputs.json_object()))
        elif fmt is not None and fmt.json_schema is not None:
            spec = StructuredOutputs.json(fmt.json_schema.schema_)
            fields.append(("response_format.json_schema.schema", spec))
        so = self.structured_outputs
        if so is not None:
            given = [
                (name, value)
                for name, value in (
                    ("json", so.json_),
                    ("json_object", so.json_object or None),
                    ("regex", so.regex),
                    ("choice", so.choice),
                    ("grammar", so.grammar),
                )
                if value is not None
            ]
            if len(given) != 1:
                raise invalid(
                    "structured_outputs takes exactly one of json, json_object, regex, choice, "
                    f"grammar (got {', '.join(n for n, _ in given) or 'none'})",
                    "structured_outputs",
                )
            name, value = given[0]
            fields.append((f"structured_outputs.{name}", _spec(name, value)))
        fields += [
            ("guided_json", None if self.guided_json is None else _spec("json", self.guided_json)),
            ("guided_regex", _spec("regex", self.guided_regex)),
            ("guided_choice", _spec("choice", self.guided_choice)),
            ("guided_grammar", _spec("grammar", self.guided_grammar)),
        ]
        return fields

    def _options(self, max_tokens: int | None, logprobs: int | None) -> Options:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return Options(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            structured=self._spec,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            n=self.n,
            session_id=self.session_id or self.user or "",
            priority=self.priority,
            timeout=self.timeout,
            num_speculative_tokens=self.num_speculative_tokens,
        )


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`"""

    chat: ClassVar[bool] = False
    prompt: str | list[int]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    NO_OP: ClassVar[dict[str, tuple[Any, ...]]] = _GenerationRequest.NO_OP | {"suffix": ("",)}

    def _check(self) -> None:
        super()._check()
        if self.echo and self.logprobs is not None:
            raise invalid("echo with logprobs is not supported (no prompt logprobs)", "echo")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise invalid("best_of greater than n cannot be streamed", "best_of")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """A string, a list of token ids, or a list holding one of either."""
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return value
            if all(isinstance(v, str | list) for v in value):
                raise ValueError("only one prompt per request is supported")
        raise ValueError("prompt must be a string or a list of token ids")

    @property
    def options(self) -> Options:
        return replace(self._options(self.max_tokens, self.logprobs), best_of=self.best_of)

    def default_max_tokens(self) -> int | None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`"""

    chat: ClassVar[bool] = True
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="auto (the default with tools): the model may call; required: it calls "
        "at least one tool; a named function: it calls that one; none: it answers in text. "
        "required and a named function are enforced by a grammar, so the calls always parse",
    )
    parallel_tool_calls: bool = Field(
        True, description="false: at most one call (enforced under required / a named function)"
    )

    def _check(self) -> None:
        self._check_tools()
        super()._check()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or ()]
        for i, tool in enumerate(self.tools or ()):
            if names.index(tool.function.name) != i:
                raise invalid(f"tools: two tools are named {tool.function.name!r}", "tools")
            if tool.function.parameters is not None:
                param = f"tools[{i}].function.parameters"
                try:
                    StructuredOutputs.json(tool.function.parameters).validate(param)
                except InvalidRequestError as exc:
                    raise invalid(str(exc), exc.param) from None
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise invalid("tool_choice requires tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid(
                f"tool_choice names {choice.function.name!r}, which is not in tools",
                "tool_choice",
            )

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        return "named" if isinstance(choice, NamedToolChoice) else choice

    def tool_parser(self) -> ToolCallParser | None:
        """A parser for one choice's output; None when the output is not read for calls."""
        if self.tool_mode == "none":
            return None
        names = frozenset(t.function.name for t in self.tools or ())
        streamed = self.tool_mode in ("required", "named")
        return ToolCallParser(names, streamed, max_calls=None if self.parallel_tool_calls else 1)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's shape, unset fields left out)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def _structured_fields(self) -> list[tuple[str, StructuredOutputs | None]]:
        return [("tool_choice", self._tool_grammar()), *super()._structured_fields()]

    def _tool_grammar(self) -> StructuredOutputs | None:
        """required / a named function: a grammar of the calls the output must be."""
        if self.tool_mode not in ("required", "named"):
            return None
        tools = [
            (t.function.name, t.function.parameters or {"type": "object"}) for t in self.tools or ()
        ]
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t[0] == self.tool_choice.function.name]
        parallel = self.parallel_tool_calls and self.tool_mode == "required"
        return StructuredOutputs.grammar(tool_grammar(tools, parallel))

    @property
    def options(self) -> Options:
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self._options(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def default_max_tokens(self) -> int | None:
        return None  # as many as the context leaves room for

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as transformers' chat templates take them: tool calls with their
        arguments as objects."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                d["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": c.type,
                        "function": {
                            "name": c.function.name,
                            "arguments": json.loads(c.function.arguments),
                        },
                    }
                    for c in m.tool_calls
                ]
            out.append(d)
        return out


class TokenizeCompletionRequest(_Strict):
    """`POST /tokenize` of a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """`POST /tokenize` of chat messages, through the chat template (vLLM's shape)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    # The same rendering as a chat completion's (they read only messages and tools).
    message_dicts = ChatCompletionRequest.message_dicts
    tool_dicts = ChatCompletionRequest.tool_dicts


class DetokenizeRequest(_Strict):
    """`POST /detokenize` (vLLM's shape)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class LoadLoraAdapterRequest(_Strict):
    """`POST /v1/load_lora_adapter` (vLLM's shape): serve a PEFT adapter as model `lora_name`."""

    lora_name: str
    lora_path: str  # the adapter directory, as every worker (and this frontend) sees it


class UnloadLoraAdapterRequest(_Strict):
    """`POST /v1/unload_lora_adapter` (vLLM's shape)."""

    lora_name: str
    lora_int_id: int | None = None  # vLLM's, accepted and unused: names identify adapters


R = TypeVar(
    "R",
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)


def _spec(kind: str, value: Any) -> StructuredOutputs | None:
    if value is None:
        return None
    match kind:
        case "json":
            return StructuredOutputs.json(value)
        case "json_object":
            return StructuredOutputs.json_object()
        case "regex":
            return StructuredOutputs.regex(value)
        case "choice":
            return StructuredOutputs.choice(value)
    return StructuredOutputs.grammar(value)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8: {exc}") from None
    try:
        # NaN and Infinity are not JSON (Python's parser takes them), nor is 1e999.
        body = json.loads(text, parse_constant=_not_a_number, parse_float=_finite)
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    if "\\u" in text:  # only an escape can make a lone surrogate: look only then
        _check_unicode(body)
    return body


def _not_a_number(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _check_unicode(body: Any) -> None:
    """Refuse a string holding a lone surrogate (JSON lets "\\ud800" through; no
    tokenizer or encoder takes it). Iterative: the body may be nested deeply."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise invalid(
                    "the request body has a string with a lone UTF-16 surrogate "
                    f"(an unpaired \\u escape): {value[:40]!r}"
                ) from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def parse(cls: type[R], body: dict[str, Any]) -> R:
    """Validate `body` as a `cls`; FrontendError (400) naming the first bad parameter."""
    # JSON numbers like 8.0 are integers to OpenAI's API; strict mode would refuse them.
    body = {
        k: int(v) if k in _INTS and isinstance(v, float) and v.is_integer() else v
        for k, v in body.items()
    }
    try:
        request = cls.model_validate(body)
    except ValidationError as exc:
        raise _to_frontend_error(exc) from None
    if isinstance(request, _GenerationRequest):
        request._check()
    return request


_INTS = frozenset(
    {"n", "seed", "top_k", "min_tokens", "priority", "max_tokens", "max_completion_tokens"}
    | {"num_speculative_tokens"}
    | {"logprobs", "top_logprobs", "best_of"}
)


def _to_frontend_error(exc: ValidationError) -> FrontendError:
    err = exc.errors(include_url=False)[0]
    param = _param(err["loc"])
    if err["type"] == "extra_forbidden":
        return invalid(f"{param} is not a supported parameter", param)
    if err["type"] == "missing":
        return invalid(f"{param} is required", param)
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":  # our own validators' messages name the field already
        return invalid(message, param)
    return invalid(f"{param}: {message}" if param else message, param)


def _param(loc: tuple[int | str, ...]) -> str | None:
    """("messages", 0, "role") -> "messages[0].role"; union branch tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "bool", "float", "dict", "list"):
            break  # a union branch's name (e.g. "list[int]"): the field itself is the param
        else:
            out += f".{part}" if out else part
    return out or None


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 description of the endpoints that take a body, from the request
    models."""
    from pydantic.json_schema import models_json_schema

    models = [
        (m, "validation")
        for m in (
            CompletionRequest,
            ChatCompletionRequest,
            TokenizeCompletionRequest,
            TokenizeChatRequest,
            DetokenizeRequest,
            LoadLoraAdapterRequest,
            UnloadLoraAdapterRequest,
        )
    ]
    _, schemas = models_json_schema(models, ref_template="#/components/schemas/{model}")
    error = {
        "description": "An OpenAI error body",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    components = schemas.get("$defs", {}) | {
        "Error": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        k: {"type": ["string", "null"]}
                        for k in ("message", "type", "param", "code")
                    },
                }
            },
        }
    }

    def post(model: str | tuple[str, ...], summary: str, reply: str) -> dict[str, Any]:
        names = (model,) if isinstance(model, str) else model
        refs = [{"$ref": f"#/components/schemas/{m}"} for m in names]
        body = {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": body},
                "responses": {
                    "200": {"description": reply},
                    **{status: error for status in ("400", "404", "413", "429", "503", "504")},
                },
            }
        }

    stream = "The completion (JSON), or server-sent events when stream is true"
    return {
        "openapi": "3.1.0",
        "info": {"title": "rtp-serve OpenAI-compatible API", "version": "1"},
        "paths": {
            "/v1/completions": post("CompletionRequest", "Create a completion", stream),
            "/v1/chat/completions": post(
                "ChatCompletionRequest", "Create a chat completion", stream
            ),
            "/tokenize": post(
                ("TokenizeCompletionRequest", "TokenizeChatRequest"),
                "Tokenize a prompt, or chat messages through the chat template",
                "{count, max_model_len, tokens, token_strs}",
            ),
            "/detokenize": post("DetokenizeRequest", "Token ids to text", "{prompt}"),
            "/v1/load_lora_adapter": post(
                "LoadLoraAdapterRequest", "Serve a LoRA adapter on every worker", "a message"
            ),
            "/v1/unload_lora_adapter": post(
                "UnloadLoraAdapterRequest", "Stop serving a LoRA adapter", "a message"
            ),
        },
        "components": {"schemas": components},
    }
