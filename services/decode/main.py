"""`rtp-serve decode` (PD decode worker) and `rtp-serve fused` (prefill and decode in one)."""

from __future__ import annotations

import argparse

from rtp_serve.services.common.pb import nameservice_pb2
from rtp_serve.services.decode.servicer import DecodeServicer
from rtp_serve.services.worker.config import add_worker_arguments
from rtp_serve.services.worker.serve import serve_worker
from rtp_serve.services.worker.tiers import add_tier_arguments, cache_client


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    add_worker_arguments(p)
    p.set_defaults(fused=name == "fused")
    add_tier_arguments(p)


async def serve(args: argparse.Namespace) -> None:
    role = nameservice_pb2.ROLE_FUSED if args.fused else nameservice_pb2.ROLE_DECODE

    # A decode worker also serves fused requests if asked (e.g. when no prefill worker is
    # left): degraded, but the request is served, through the tiers like a fused worker's.
    def make(llm, args):
        return DecodeServicer(
            llm,
            allow_fused=True,
            role=role,
            cache=cache_client(args),
            remote_write=args.remote_write,
        )

    await serve_worker(args, role, make)
