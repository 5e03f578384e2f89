"""The OpenAI-compatible HTTP API (aiohttp): /v1/models, /v1/completions,
/v1/chat/completions (optionally as server-sent events), /health, /ready and /metrics.

Every refusal is an OpenAI error body; see errors.py for the status of each kind. Run the
app with `handler_cancellation=True` (main.py does): a client that goes away then cancels
its handler, and the cancellation reaches the worker calls through generation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import replace
from typing import Any

import jinja2
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from rtp_serve.services.common import metrics, tracing
from rtp_serve.services.frontend import auth
from rtp_serve.services.frontend import metrics as frontend_metrics
from rtp_serve.services.frontend.adapters import load_adapter, unload_adapter
from rtp_serve.services.frontend.auth import ApiKeys
from rtp_serve.services.frontend.errors import ErrorKind, FrontendError, invalid
from rtp_serve.services.frontend.fanout import merge, start_all
from rtp_serve.services.frontend.generation import Delta, DeltaStream, Generator
from rtp_serve.services.frontend.inputs import GenerateInput, prepare
from rtp_serve.services.frontend.limits import Limits, too_large
from rtp_serve.services.frontend.openai_responses import Choice, ResponseBuilder, best
from rtp_serve.services.frontend.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoraAdapterRequest,
    openapi,
    parse,
    parse_json,
)
from rtp_serve.services.frontend.tool_prompt import inline_tools

log = logging.getLogger(__name__)

# A client may name its request (the response's id and this header carry the name back). A
# name in flight is not admitted twice, so a client retrying a request whose answer it lost
# never has it generated twice at once.
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
GENERATOR = web.AppKey("generator", Generator)
KEYS = web.AppKey("keys", ApiKeys)
_STARTED = int(time.time())


def build_app(generator: Generator, keys: ApiKeys | None = None) -> web.Application:
    """The app; with `keys`, requests without a valid API key get a 401 (see auth.py)."""
    keys = keys or ApiKeys()
    middlewares = [frontend_metrics.http_middleware(), auth.middleware(keys)]
    middlewares += [_traced, _errors]
    max_body = generator.limits.max_body_bytes
    app = web.Application(middlewares=middlewares, client_max_size=max_body)
    app[GENERATOR] = generator
    app[KEYS] = keys
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_post("/v1/load_lora_adapter", _load_lora)
    app.router.add_post("/v1/unload_lora_adapter", _unload_lora)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", metrics.handle_metrics)
    return app


LINGER_S = 1.0


def server_options(limits: Limits) -> dict[str, Any]:
    """What the aiohttp server (AppRunner, TestServer) runs the app with. aiohttp closes a
    connection that has sent no complete request headers `keepalive_timeout` after it opened
    or was last answered: that is the header timeout, against slow-loris clients. After an
    answer to a request whose body was not read (a 408, a 413), aiohttp reads and drops the
    rest for `lingering_time` (so the client sees the answer, not a reset) before closing:
    LINGER_S, not its default 10 s."""
    return {"keepalive_timeout": limits.header_timeout_s, "lingering_time": LINGER_S}


def client_identity(request: web.Request) -> str:
    """Who a request is from, for the per-client bounds: its remote address. (With API
    keys, the key's identity instead.)"""
    return request.remote or "unknown"


RETRY_AFTER_S = 1  # what a 429 tells the client to wait: queues here drain in about that


def error_response(exc: FrontendError) -> web.Response:
    headers = None
    if exc.kind == ErrorKind.OVERLOADED:
        headers = {"Retry-After": str(exc.retry_after or RETRY_AFTER_S)}
    resp = web.json_response(exc.body(), status=exc.kind.http_status, headers=headers)
    if exc.kind in (ErrorKind.SLOW_CLIENT, ErrorKind.TOO_LARGE):
        resp.force_close()  # the rest of the body is not worth reading
    return resp


async def read_body(request: web.Request) -> bytes:
    """The whole body, within --body-timeout of the headers (408 after: a slow client)."""
    limits = request.app[GENERATOR].limits
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise FrontendError(
            ErrorKind.SLOW_CLIENT,
            f"the request body did not arrive within {limits.body_timeout_s:g} s",
            code="request_timeout",
        ) from None


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except FrontendError as exc:
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        return error_response(too_large(request.app[GENERATOR].limits.max_body_bytes))
    except web.HTTPException as exc:  # unknown path, wrong method, ...
        body = {"error": {"message": exc.reason, "type": "invalid_request_error"}}
        body["error"] |= {"param": None, "code": None}
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.json_response(body, status=exc.status, headers=allow)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(FrontendError(ErrorKind.INTERNAL, "internal server error"))


# -- endpoints -----------------------------------------------------------------------------
async def _models(request: web.Request) -> web.Response:
    gen = request.app[GENERATOR]
    model = gen.model
    card = {
        "id": model.served_name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "rtp-serve",
        "root": model.path,
        "parent": None,
        "max_model_len": model.context_len,
    }
    # LoRA adapters as vLLM lists them: their own ids, `parent` the base model's.
    loras = [
        card | {"id": a.name, "created": a.created, "root": a.path, "parent": model.served_name}
        for a in gen.adapters
    ]
    return web.json_response({"object": "list", "data": [card, *loras]})


async def _load_lora(request: web.Request) -> web.Response:
    gen = request.app[GENERATOR]
    req = parse(LoadLoraAdapterRequest, parse_json(await read_body(request)))
    if req.lora_name == gen.model.served_name:
        raise invalid(f"`{req.lora_name}` is the base model's name", "lora_name")
    path = gen.adapters.under_root(req.lora_path)  # 403 outside --lora-root, or without one
    await load_adapter(gen.adapters, gen.router, req.lora_name, path)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def _unload_lora(request: web.Request) -> web.Response:
    gen = request.app[GENERATOR]
    req = parse(UnloadLoraAdapterRequest, parse_json(await read_body(request)))
    await unload_adapter(gen.adapters, gen.router, req.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    generator = request.app[GENERATOR]
    router = generator.router
    workers = router.num_workers()  # (a launcher waits for all it started)
    if await router.ready():
        return web.json_response({"status": "ready", "workers": workers})
    if generator.worker_wait.hold_s > 0:  # scaled to zero: requests wait for a worker here
        return web.json_response({"status": "ready, holding for a worker", "workers": workers})
    return web.json_response({"status": "no route to a worker", "workers": workers}, status=503)


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi())


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CompletionRequest)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ChatCompletionRequest)


async def _generate(
    request: web.Request, kind: type[CompletionRequest] | type[ChatCompletionRequest]
) -> web.StreamResponse:
    """Both generation endpoints: validate, tokenize, fan out `n`, route, respond."""
    gen = request.app[GENERATOR]
    req = parse(kind, parse_json(await read_body(request)))
    request.app[KEYS].check_priority(req.priority, request.headers.get("Authorization"))
    lora = gen.resolve_model(req.model)
    client_id = _client_request_id(request)
    with gen.admission.admit(client_id), gen.client_streams.admit(client_identity(request)):
        with tracing.tracer.start_as_current_span("tokenize"):
            ids = _prompt_ids(gen, req)
        opts = replace(req.options, lora=lora)
        if req.speculative_advice:
            _check_advice_chars(req.speculative_advice, gen.model.context_len)
            advice = gen.tokenizer.encode(req.speculative_advice, add_special_tokens=False)
            opts = replace(opts, speculative_advice=tuple(advice))
        builder = ResponseBuilder(
            req.chat, req.model, gen.token_text, opts.logprobs is not None, client_id
        )
        prompt_param = "messages" if req.chat else "prompt"
        logprobs_param = "top_logprobs" if req.chat else "logprobs"
        inputs = prepare(
            gen.model,
            gen.limits,
            builder.id,
            ids,
            opts,
            req.default_max_tokens(),
            prompt_param,
            logprobs_param,
        )
        if isinstance(req, ChatCompletionRequest):
            choices = [Choice(parser=req.tool_parser()) for _ in inputs]
        else:  # echo: each choice's text starts with the prompt
            echo = _prompt_text(gen, req, ids) if req.echo else ""
            choices = [Choice(text=echo) for _ in inputs]
        tenant = request.app[KEYS].tenant(request.headers.get("Authorization"))
        trace.get_current_span().set_attribute(tracing.TENANT, tenant.name)
        with gen.tenants.admit(tenant, len(ids)) as lease:  # 429 over the tenant's limits
            inputs = [replace(inp, tenant=lease) for inp in inputs]
            return await _respond(
                request, gen, builder, inputs, choices, req.stream, req.include_usage, opts.n
            )


def _check_advice_chars(advice: str, context_len: int) -> None:
    """Refuse, before tokenizing it on the event loop, an advice longer than the context in
    characters: a worker searches it every step, and past the context it cannot help."""
    if len(advice) > context_len:
        raise invalid(
            f"speculative_advice has {len(advice)} characters; at most {context_len} (the "
            "model's context length) are allowed",
            "speculative_advice",
        )


def _client_request_id(request: web.Request) -> str | None:
    """The request id the client chose (X-Request-Id), checked; None if it chose none."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if not _REQUEST_ID.fullmatch(value):
        raise invalid(
            f"the {REQUEST_ID_HEADER} header must be 1 to 128 letters, digits or any of '._:@-'",
            REQUEST_ID_HEADER,
        )
    return value


def _prompt_ids(gen: Generator, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
    if isinstance(req, CompletionRequest):
        prompt = req.prompt
        if not isinstance(prompt, str):
            return list(prompt)
        return _encode(gen, prompt, "prompt")
    return _encode(gen, _chat_text(gen, req), "messages", add_special_tokens=False)


def _encode(gen: Generator, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenize, refusing first a text too long to fit at all (tokenizing megabytes would
    hold the event loop)."""
    gen.limits.check_prompt_chars(text, gen.model.context_len, gen.max_token_chars, param)
    return gen.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _prompt_text(gen: Generator, req: CompletionRequest, ids: list[int]) -> str:
    return req.prompt if isinstance(req.prompt, str) else gen.tokenizer.decode(ids)


def _chat_text(
    gen: Generator, req: ChatCompletionRequest | TokenizeChatRequest, generation_prompt: bool = True
) -> str:
    """The chat template applied to the messages, with the tools where the template takes
    them and written into the messages where it does not (tool_prompt.py)."""
    tools, messages = req.tool_dicts(), req.message_dicts()
    tok = gen.tokenizer
    try:
        if tok.renders_tools:
            return tok.apply_chat_template(messages, generation_prompt, tools=tools)
        return tok.apply_chat_template(inline_tools(messages, tools), generation_prompt)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise invalid(f"cannot apply the chat template: {exc}", "messages") from None


async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a prompt, or chat messages through the template."""
    gen = request.app[GENERATOR]
    body = parse_json(await read_body(request))
    kind = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    req = parse(kind, body)
    if req.model is not None:
        _check_model(gen, req.model)
    if isinstance(req, TokenizeChatRequest):
        text, param = _chat_text(gen, req, req.add_generation_prompt), "messages"
    else:
        text, param = req.prompt, "prompt"
    tokens = _encode(gen, text, param, req.add_special_tokens)
    strs = [gen.tokenizer.id_to_token(t) for t in tokens] if req.return_token_strs else None
    return web.json_response(
        {
            "count": len(tokens),
            "max_model_len": gen.model.context_len,
            "tokens": tokens,
            "token_strs": strs,
        }
    )


async def _detokenize(request: web.Request) -> web.Response:
    gen = request.app[GENERATOR]
    req = parse(DetokenizeRequest, parse_json(await read_body(request)))
    if req.model is not None:
        _check_model(gen, req.model)
    bad = [t for t in req.tokens if t >= gen.model.vocab_size]
    if bad:
        raise invalid(f"token ids out of range [0, {gen.model.vocab_size}): {bad[:5]}", "tokens")
    # As vLLM (transformers' decode): special tokens are kept.
    text = gen.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return web.json_response({"prompt": text})


def _check_model(gen: Generator, model: str) -> None:
    gen.resolve_model(model)  # 404 naming it


# -- responses -----------------------------------------------------------------------------
async def _respond(
    request: web.Request,
    gen: Generator,
    builder: ResponseBuilder,
    inputs: list[GenerateInput],
    choices: list[Choice],
    stream: bool,
    include_usage: bool,
    n: int,
) -> web.StreamResponse:
    """`n`: the choices the client gets (fewer than `choices` with best_of: the best)."""
    # Every choice is routed and has its first tokens before anything is sent, so a request
    # nobody can serve still gets a proper error status.
    span = trace.get_current_span()
    _trace_request(span, builder, inputs)
    streams = await start_all(gen, inputs)
    if span.is_recording():
        span.set_attribute(tracing.TIME_TO_FIRST_TOKEN, tracing.seconds_since_start(span) or 0.0)
    try:
        if not stream:
            async with contextlib.aclosing(merge(streams)) as deltas:
                async for i, delta in deltas:
                    choices[i].add(delta)
            shown = best(choices, n)
            return web.json_response(
                builder.response(shown, choices), headers={REQUEST_ID_HEADER: builder.id}
            )
        return await _stream_sse(request, builder, streams, choices, include_usage)
    finally:
        _trace_usage(span, choices)
        for s in streams:
            await s.aclose()


async def _stream_sse(
    request: web.Request,
    builder: ResponseBuilder,
    streams: list[DeltaStream],
    choices: list[Choice],
    include_usage: bool,
) -> web.StreamResponse:
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    resp = web.StreamResponse(headers=headers | {REQUEST_ID_HEADER: builder.id})
    try:
        await resp.prepare(request)  # the client may be gone already
        if builder.chat:  # OpenAI opens each chat choice with the assistant role
            for i in range(len(choices)):
                tools = choices[i].parser is not None
                await _send(resp, builder.chunk(i, None, include_usage, role=True, tools=tools))
        for i, choice in enumerate(choices):  # what a choice starts with (echo)
            if choice.text:
                start = Delta(choice.text, [], [], None, 0, 0, 0)
                await _send(resp, builder.chunk(i, start, include_usage))
        try:
            async with contextlib.aclosing(merge(streams)) as deltas:
                async for i, delta in deltas:
                    delta, calls = choices[i].add(delta)
                    if delta.text or calls or delta.logprobs or delta.finish_reason:
                        await _send(resp, builder.chunk(i, delta, include_usage, tool_calls=calls))
            if include_usage:
                await _send(resp, builder.usage_chunk(choices))
        except FrontendError as exc:  # the status line is gone: report in the stream
            log.warning(
                "request %s failed mid-stream: %s",
                builder.id,
                exc.message,
                extra={"request_id": builder.id},
            )
            await _send(resp, exc.body())
        except Exception:
            log.exception(
                "request %s failed mid-stream", builder.id, extra={"request_id": builder.id}
            )
            await _send(resp, FrontendError(ErrorKind.INTERNAL, "internal server error").body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        log.info("request %s: client went away", builder.id, extra={"request_id": builder.id})
    return resp


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")


# -- tracing -------------------------------------------------------------------------------
@web.middleware
async def _traced(request: web.Request, handler: Any) -> web.StreamResponse:
    """A request's SERVER span (vLLM's `llm_request`), child of an incoming `traceparent`."""
    if request.method != "POST" or not tracing.enabled():
        return await handler(request)
    attributes = {"http.request.method": request.method, "url.path": request.path}
    with tracing.http_server_span("llm_request", request.headers, attributes) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(StatusCode.ERROR)
        return response


def _trace_request(span: Span, builder: ResponseBuilder, inputs: list[GenerateInput]) -> None:
    if not span.is_recording():
        return
    params = inputs[0].params
    span.set_attributes(
        {
            tracing.REQUEST_ID: builder.id,
            tracing.REQUEST_MODEL: builder.model,
            tracing.REQUEST_N: len(inputs),
            tracing.REQUEST_MAX_TOKENS: params.max_tokens,
            tracing.REQUEST_TEMPERATURE: params.temperature,
            tracing.REQUEST_TOP_P: params.top_p,
            tracing.PROMPT_TOKENS: len(inputs[0].prompt_token_ids),
        }
    )


def _trace_usage(span: Span, choices: list[Choice]) -> None:
    if not span.is_recording():
        return
    span.set_attributes(
        {
            tracing.COMPLETION_TOKENS: sum(c.completion_tokens for c in choices),
            tracing.CACHED_TOKENS: max(c.cached_tokens for c in choices),
            tracing.FINISH_REASONS: [c.finish_reason or "" for c in choices],
            tracing.E2E_LATENCY: tracing.seconds_since_start(span) or 0.0,
        }
    )
