"""`rtp-serve prefill`: a worker that computes prompts and hands their KV to decode workers."""

from __future__ import annotations

import argparse

from services.common.pb import nameservice_pb2
from services.common.worker import add_worker_arguments, serve_worker
from services.prefill.servicer import PrefillServicer


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    add_worker_arguments(p)


async def serve(args: argparse.Namespace) -> None:
    await serve_worker(args, nameservice_pb2.ROLE_PREFILL, lambda llm, _: PrefillServicer(llm))
