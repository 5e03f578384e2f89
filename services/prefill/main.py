"""`rtp-serve prefill`: a worker that computes prompts and hands their KV to decode workers."""

from __future__ import annotations

import argparse

from services.cache.client import CacheClient
from services.common.pb import nameservice_pb2
from services.prefill.servicer import PrefillServicer
from services.worker.config import add_worker_arguments
from services.worker.serve import serve_worker


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    add_worker_arguments(p)
    p.add_argument(
        "--no-remote-cache",
        action="store_true",
        help="do not use the cache service tier (found through the nameservice)",
    )


async def serve(args: argparse.Namespace) -> None:
    def make(llm, args):
        cache = None if args.no_remote_cache else CacheClient([])
        return PrefillServicer(llm, cache)

    await serve_worker(args, nameservice_pb2.ROLE_PREFILL, make)
