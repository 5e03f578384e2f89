"""A worker's flags and the engine they build."""

from __future__ import annotations

import argparse

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from services.common.flags import DEFAULT_MODEL_HELP, add_common_flags, env


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    add_common_flags(p)
    p.add_argument("--model", default=env("model"), help=f"model directory ({DEFAULT_MODEL_HELP})")
    p.add_argument("--dtype", default=env("dtype", "float32"))
    p.add_argument("--device", default=env("device", "cpu"), help="cpu, cuda, cuda:1, ...")
    p.add_argument("--block-size", type=int, default=int(env("block_size", "16")))
    p.add_argument("--kv-cache-mib", type=int, default=int(env("kv_cache_mib", "256")))
    p.add_argument("--max-num-seqs", type=int, default=int(env("max_num_seqs", "64")))
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=int(env("max_num_batched_tokens", "2048"))
    )
    p.add_argument(
        "--threads",
        type=int,
        default=int(env("threads", "0")),
        help="torch threads (0: torch's default); workers sharing a machine split its cores",
    )


def build_llm(args: argparse.Namespace) -> AsyncLLM:
    model = args.model
    if model is None:
        from engine.make_model import ensure_model

        model = str(ensure_model())
    config = EngineConfig(
        model=model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads or None,
    )
    return AsyncLLM(config, record_kv_events=True)
