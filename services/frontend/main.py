"""`rtp-serve frontend`: the OpenAI HTTP API plus the gRPC Frontend service.

Never imports torch: it only tokenizes, hashes, routes and streams.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os

from aiohttp import web

from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.env import env
from rtp_serve.services.common.flags import (
    add_common_flags,
    add_drain_flag,
    add_lora_flags,
    advertised,
    int_or_none,
)
from rtp_serve.services.common.naming import NameClient, make_member
from rtp_serve.services.common.pb import frontend_pb2_grpc
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from rtp_serve.services.frontend import auth
from rtp_serve.services.frontend.adapters import Adapters
from rtp_serve.services.frontend.generation import DEFAULT_MAX_MIGRATIONS, Generator
from rtp_serve.services.frontend.grpc_api import FrontendServicer
from rtp_serve.services.frontend.http_api import build_app, server_options
from rtp_serve.services.frontend.limits import Limits, add_limit_flags
from rtp_serve.services.frontend.model_info import ModelInfo
from rtp_serve.services.frontend.router_client import Router

log = logging.getLogger(__name__)

GRPC_SERVICE = "rtp.v1.Frontend"


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    add_common_flags(p, nats=False)  # --port is the HTTP port; no NATS: it never uses it
    auth.add_auth_flags(p)
    add_drain_flag(p, "the streams in flight")
    p.add_argument("--grpc-port", type=int, default=int(env("grpc_port", "0")))
    p.add_argument(
        "--model",
        default=env("model"),
        required=env("model") is None,
        help="model directory (its tokenizer and config.json; block size and cache salt "
        "are learnt from the workers' registration)",
    )
    p.add_argument(
        "--served-model-name",
        default=env("served_model_name"),
        help="the model's name in the API (default: the model directory's name)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=int_or_none(env("max_model_len")),
        help="context length (default: max_position_embeddings of config.json)",
    )
    p.add_argument(
        "--max-concurrent",
        type=int,
        default=int(env("max_concurrent", "256")),
        help="requests in flight; more are refused with 429",
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        default=int(env("max_migrations", str(DEFAULT_MAX_MIGRATIONS))),
        help="times a sequence may move to another worker after its worker failed",
    )
    p.add_argument(
        "--master",
        default=env("master"),
        help="host:port of the master, or several comma-separated (active-active replicas: "
        "requests spread over them, and move to another when one fails); default: the "
        "masters the nameservice knows",
    )
    p.add_argument(
        "--log-requests",
        action="store_true",
        default=env("log_requests", "") not in ("", "0", "false"),
        help="log one line per request at its first token: the worker, the master's predicted "
        "time to first token term by term, and the actual one with the worker's queue and prefill",
    )
    add_lora_flags(p, max_loras=False)  # the workers' --lora: served as models, hashed alike
    p.add_argument(
        "--lora-root",
        default=env("lora_root"),
        metavar="DIR",
        help="the directory POST /v1/load_lora_adapter may load adapters from (a path that "
        "resolves outside it is refused); without it, loading at run time is refused (403)",
    )
    add_limit_flags(p)


async def serve(args: argparse.Namespace) -> None:
    model = ModelInfo.load(args.model, args.served_model_name, args.max_model_len)
    tokenizer = await asyncio.to_thread(Tokenizer, args.model)
    names = NameClient(args.nameservice) if args.nameservice else None
    router = Router(args.master, names.watch if names is not None else None)
    if names is None:
        log.warning("no --nameservice: the workers' block size and cache salt stay unknown, "
                    "so requests are routed without their prefix's block hashes")  # fmt: skip
    adapters = Adapters(args.lora_root)
    adapters.load_flags(args.loras)
    limits = Limits.from_args(args)
    keys = auth.from_args(args)
    generator = Generator(
        model,
        tokenizer,
        router,
        max_concurrent=args.max_concurrent,
        limits=limits,
        max_migrations=args.max_migrations,
        adapters=adapters,
        log_requests=args.log_requests,
        tenants=keys.tenants,
        frontend_replicas=args.frontend_replicas,
    )
    runner = web.AppRunner(
        build_app(generator, keys),
        handler_cancellation=True,  # a client that goes away cancels its worker calls
        **server_options(limits),  # the header timeout
        access_log=None,
        shutdown_timeout=args.drain_timeout,  # on SIGTERM: stop listening, finish streams
    )
    server, grpc_port, health = grpc_util.create_server(f"{args.host}:{args.grpc_port}")
    frontend_pb2_grpc.add_FrontendServicer_to_server(FrontendServicer(generator, keys), server)
    await router.start()
    try:
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        http_port = runner.addresses[0][1]
        await server.start()
        await grpc_util.set_serving(health, GRPC_SERVICE, True)
        grpc_address = advertised(args, grpc_port)
        member = make_member(
            ns_pb2.ROLE_FRONTEND,
            grpc_address,
            model=model.served_name,
            metrics_address=advertised(args, http_port),  # GET /metrics on the HTTP port
            member_id=router.frontend_id,  # the id the master leases request ids to
        )
        if names is not None:
            await names.register(member)
        url = f"http://{advertised(args, http_port)}"
        log.info(
            "frontend ready url=%s grpc=%s model=%s id=%s pid=%d",
            url,
            grpc_address,
            model.served_name,
            member.id,
            os.getpid(),
        )
        await asyncio.Event().wait()  # until cancelled (SIGTERM)
    finally:
        # Drain: leave the nameservice, stop listening, and give the streams in flight
        # (HTTP and gRPC together) up to --drain-timeout to finish.
        await grpc_util.set_serving(health, GRPC_SERVICE, False)
        if names is not None:
            with contextlib.suppress(Exception):
                await names.close()
        await asyncio.gather(runner.cleanup(), server.stop(grace=args.drain_timeout))
        await router.close()
