"""The OpenAI-compatible HTTP API (aiohttp): /v1/models, /v1/completions,
/v1/chat/completions (optionally as server-sent events), /health and /ready.

Every refusal is an OpenAI error body; see errors.py for the status of each kind. Run the
app with `handler_cancellation=True` (main.py does): a client that goes away then cancels
its handler, and the cancellation reaches the worker calls through generation.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

import jinja2
from aiohttp import web

from services.frontend.errors import ErrorKind, FrontendError, invalid
from services.frontend.fanout import merge, start_all
from services.frontend.generation import DeltaStream, Generator
from services.frontend.inputs import GenerateInput
from services.frontend.openai_responses import Choice, ResponseBuilder
from services.frontend.openai_schema import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    parse_chat,
    parse_completion,
    parse_json,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
GENERATOR = web.AppKey("generator", Generator)
_STARTED = int(time.time())


def build_app(generator: Generator) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[GENERATOR] = generator
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    return app


def error_response(exc: FrontendError) -> web.Response:
    return web.json_response(exc.body(), status=exc.kind.http_status)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except FrontendError as exc:
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(FrontendError(ErrorKind.TOO_LARGE, exc.text or "body too large"))
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
    model = request.app[GENERATOR].model
    card = {
        "id": model.served_name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "rtp-serve",
        "max_model_len": model.context_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    if await request.app[GENERATOR].router.ready():
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "no route to a worker"}, status=503)


async def _completions(request: web.Request) -> web.StreamResponse:
    gen = request.app[GENERATOR]
    req = parse_completion(parse_json(await request.read()))
    _check_model(gen, req.model)
    with gen.admission.admit():
        ids = gen.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
        builder = ResponseBuilder(
            False, req.model, gen.token_text, req.options.logprobs is not None
        )
        inputs = gen.prepare(builder.id, ids, req.options, COMPLETIONS_DEFAULT_MAX_TOKENS)
        return await _respond(request, gen, builder, inputs, req.stream, req.include_usage)


async def _chat(request: web.Request) -> web.StreamResponse:
    gen = request.app[GENERATOR]
    req = parse_chat(parse_json(await request.read()))
    _check_model(gen, req.model)
    with gen.admission.admit():
        try:
            text = gen.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise invalid(f"cannot apply the chat template: {exc}", "messages") from None
        ids = gen.tokenizer.encode(text, add_special_tokens=False)
        builder = ResponseBuilder(True, req.model, gen.token_text, req.options.logprobs is not None)
        inputs = gen.prepare(builder.id, ids, req.options, None, prompt_param="messages")
        return await _respond(request, gen, builder, inputs, req.stream, req.include_usage)


def _check_model(gen: Generator, model: str) -> None:
    if model != gen.model.served_name:
        raise FrontendError(
            ErrorKind.NOT_FOUND,
            f"The model `{model}` does not exist (this server serves `{gen.model.served_name}`)",
            "model",
            "model_not_found",
        )


# -- responses -----------------------------------------------------------------------------
async def _respond(
    request: web.Request,
    gen: Generator,
    builder: ResponseBuilder,
    inputs: list[GenerateInput],
    stream: bool,
    include_usage: bool,
) -> web.StreamResponse:
    # Every choice is routed and has its first tokens before anything is sent, so a request
    # nobody can serve still gets a proper error status.
    streams = await start_all(gen, inputs)
    choices = [Choice() for _ in inputs]
    try:
        if not stream:
            async with contextlib.aclosing(merge(streams)) as deltas:
                async for i, delta in deltas:
                    choices[i].add(delta)
            return web.json_response(builder.response(choices))
        return await _stream_sse(request, builder, streams, choices, include_usage)
    finally:
        for s in streams:
            await s.aclose()


async def _stream_sse(
    request: web.Request,
    builder: ResponseBuilder,
    streams: list[DeltaStream],
    choices: list[Choice],
    include_usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    try:
        if builder.chat:  # OpenAI opens each chat choice with the assistant role
            for i in range(len(choices)):
                await _send(resp, builder.chunk(i, None, include_usage, role=True))
        try:
            async with contextlib.aclosing(merge(streams)) as deltas:
                async for i, delta in deltas:
                    choices[i].add(delta)
                    await _send(resp, builder.chunk(i, delta, include_usage))
            if include_usage:
                await _send(resp, builder.usage_chunk(choices))
        except FrontendError as exc:  # the status line is gone: report in the stream
            log.warning("request %s failed mid-stream: %s", builder.id, exc.message)
            await _send(resp, exc.body())
        except Exception:
            log.exception("request %s failed mid-stream", builder.id)
            await _send(resp, FrontendError(ErrorKind.INTERNAL, "internal server error").body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        log.info("request %s: client went away", builder.id)
    return resp


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
