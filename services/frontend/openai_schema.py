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

from engine.spec.adaptive import MAX_SPECULATIVE_TOKENS
from engine.structured import StructuredOutputs
from engine.validation import InvalidRequestError
from services.frontend.errors import FrontendError, invalid
from services.frontend.inputs import Options

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16

Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
Timeout = Annotated[
    float,
    Field(
        gt=0,
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


class ChatMessage(_Strict):
    role: Annotated[str, Field(min_length=1)]
    # A string, or content parts (text only), flattened to one string.
    content: str = ""

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
    top_k: int = -1
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0  # lower runs first
    session_id: str | None = None  # affinity key for routing (default: `user`)
    timeout: Timeout | None = None
    # Speculative decoding, where the workers run it (--speculative): this request's drafts
    # per step at most (0: off; absent: the workers' setting), and a text the output is
    # expected to repeat, such as the file being edited (RTP-LLM's sp_advice_prompt).
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    speculative_advice: str | None = None
    # Structured outputs (engine/structured.py): at most one of these per request.
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
    # OpenAI fields not implemented: allowed only with their no-op value (see _refuse).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    _spec: StructuredOutputs | None = PrivateAttr(None)

    NO_OP: ClassVar[dict[str, tuple[Any, ...]]] = {
        "frequency_penalty": (0, 0.0),
        "presence_penalty": (0, 0.0),
        "logit_bias": ({},),
        "tools": ([],),
        "tool_choice": ("none",),
        "parallel_tool_calls": (True, False),
    }

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return value

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

    NO_OP: ClassVar[dict[str, tuple[Any, ...]]] = _GenerationRequest.NO_OP | {
        "echo": (False,),
        "suffix": ("",),
        "best_of": (1,),
    }

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
        return self._options(self.max_tokens, self.logprobs)

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

    def _check(self) -> None:
        super()._check()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def options(self) -> Options:
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self._options(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def default_max_tokens(self) -> int | None:
        return None  # as many as the context leaves room for

    def message_dicts(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


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
        body = json.loads(text)
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


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
    """The OpenAPI 3.1 description of the generation endpoints, from the request models."""
    from pydantic.json_schema import models_json_schema

    models = [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")]
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

    def post(model: str, summary: str) -> dict[str, Any]:
        body = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": body},
                "responses": {
                    "200": {
                        "description": "The completion (JSON), or server-sent events when "
                        "stream is true"
                    },
                    **{status: error for status in ("400", "404", "413", "429", "503", "504")},
                },
            }
        }

    return {
        "openapi": "3.1.0",
        "info": {"title": "rtp-serve OpenAI-compatible API", "version": "1"},
        "paths": {
            "/v1/completions": post("CompletionRequest", "Create a completion"),
            "/v1/chat/completions": post("ChatCompletionRequest", "Create a chat completion"),
        },
        "components": {"schemas": components},
    }
