"""`rtp-serve prefill`: a worker that computes prompts and hands their KV to decode workers."""

from __future__ import annotations

import argparse

from rtp_serve.services.common.pb import nameservice_pb2
from rtp_serve.services.prefill.servicer import PrefillServicer
from rtp_serve.services.worker.config import add_worker_arguments
from rtp_serve.services.worker.serve import serve_worker
from rtp_serve.services.worker.tiers import add_tier_arguments, cache_client


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    add_worker_arguments(p)
    add_tier_arguments(p)


async def serve(args: argparse.Namespace) -> None:
    def make(llm, args):
        return PrefillServicer(llm, cache_client(args), args.remote_write)

    await serve_worker(args, nameservice_pb2.ROLE_PREFILL, make)
