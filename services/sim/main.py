"""`rtp-serve sim-worker`: N simulated workers of one role in this process.

Each is a whole worker as `rtp-serve fused|prefill|decode` runs it (services/worker/serve.py:
its own gRPC port, member id, registration and heartbeats, numbered KV-event stream, load
reports, Snapshot, drain), with the engine swapped for a SimLLM. They share the event loop
and one metrics server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets

from rtp_serve.core.dtypes import resolve_dtype, resolve_kv_dtype
from rtp_serve.core.model_config import ModelConfig
from rtp_serve.core.sim_cost import SimCost
from rtp_serve.engine.memory import kv_bytes_per_block
from rtp_serve.engine.sim.engine import STEP_MODES, SimConfig, SimLLM
from rtp_serve.services.common import metrics
from rtp_serve.services.common.env import env
from rtp_serve.services.common.flags import (
    add_common_flags,
    add_drain_flag,
    add_model_flags,
    advertised,
)
from rtp_serve.services.common.pb import nameservice_pb2
from rtp_serve.services.decode.servicer import DecodeServicer
from rtp_serve.services.prefill.servicer import PrefillServicer
from rtp_serve.services.worker.serve import serve_worker
from rtp_serve.services.worker.tiers import add_tier_arguments, cache_client

log = logging.getLogger(__name__)
ROLES = {
    "fused": nameservice_pb2.ROLE_FUSED,
    "prefill": nameservice_pb2.ROLE_PREFILL,
    "decode": nameservice_pb2.ROLE_DECODE,
}


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    add_common_flags(p)
    add_drain_flag(p, "requests in flight")
    add_model_flags(p)
    add_tier_arguments(p)
    p.add_argument("--role", choices=sorted(ROLES), default=env("role", "fused"))
    p.add_argument("--count", type=int, default=int(env("count", "1")), help="workers here")
    p.add_argument(
        "--model",
        default=env("model"),
        required=env("model") is None,
        help="checkpoint directory: its config.json and fingerprint (weights are not loaded)",
    )
    p.add_argument(
        "--cost",
        default=env("sim_cost"),
        help="step-time profile, JSON (bench/fit_sim.py writes one; default: built-in)",
    )
    p.add_argument(
        "--worker-id",
        default=env("worker_id"),
        help="member id (with --count > 1, a prefix: ID-0, ID-1, ...); default: fresh ones",
    )
    p.add_argument("--num-blocks", type=int, default=int(env("num_blocks", "4096")))
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=None,
        help="size the pool as a real worker's of this many MiB (the model's KV bytes per "
        "block), instead of --num-blocks",
    )
    p.add_argument(
        "--warm-blocks",
        type=int,
        default=int(env("warm_blocks", "0")),
        help="start each worker with this many blocks of synthetic prompts in its prefix cache "
        "(published as KV events; at most the pool): a master index of millions of blocks "
        "without replaying them (bench/scale.py --warm-blocks)",
    )
    p.add_argument(
        "--step",
        choices=STEP_MODES,
        default=env("sim_step", "sleep"),
        help="sleep: a step costs no CPU (many workers in one process); burn: it spends its "
        "time on a core, so workers sharing this machine slow down as real ones do",
    )
    p.add_argument("--max-num-seqs", type=int, default=int(env("max_num_seqs", "64")))
    p.add_argument("--max-num-waiting", type=int, default=int(env("max_num_waiting", "256")))
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=int(env("max_num_batched_tokens", "2048"))
    )


def num_blocks(args: argparse.Namespace) -> int:
    """--num-blocks, or the blocks a real worker's pool of --kv-cache-mib holds."""
    if args.kv_cache_mib is None:
        return args.num_blocks
    model = ModelConfig.from_dir(args.model)
    kv_dtype = resolve_kv_dtype(resolve_dtype(args.dtype, args.model), args.kv_dtype)
    return max(1, (args.kv_cache_mib << 20) // kv_bytes_per_block(model, kv_dtype, args.block_size))


def sim_config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        num_blocks=num_blocks(args),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_waiting=args.max_num_waiting,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=resolve_dtype(args.dtype, args.model),
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        step=args.step,
    )


async def serve(args: argparse.Namespace) -> None:
    if args.count <= 0:
        raise SystemExit("--count must be positive")
    if args.warm_blocks < 0:
        raise SystemExit("--warm-blocks must be >= 0")
    if args.count > 1 and args.port:
        raise SystemExit("with --count > 1 each worker takes a free port: leave --port 0")
    role = ROLES[args.role]
    config = sim_config(args)
    cost = SimCost.load(args.cost) if args.cost else SimCost()
    metrics_address = advertised(args, metrics.start_metrics_server(args.metrics_port, args.host))

    def build(_: argparse.Namespace) -> SimLLM:
        llm = SimLLM(config, cost)
        if args.warm_blocks > 0:
            llm.warm(args.warm_blocks, seed=secrets.randbits(64))  # distinct per worker
        return llm

    def make(llm, worker_args):
        if role == nameservice_pb2.ROLE_PREFILL:
            return PrefillServicer(llm, cache_client(worker_args), worker_args.remote_write)
        return DecodeServicer(
            llm,
            allow_fused=True,
            role=role,
            cache=cache_client(worker_args),
            remote_write=worker_args.remote_write,
        )

    def one(i: int) -> argparse.Namespace:
        worker_id = args.worker_id
        if worker_id and args.count > 1:
            worker_id = f"{worker_id}-{i}"
        return _with(args, worker_id)

    log.info(
        "starting %d simulated %s workers (cost profile: %s)", args.count, args.role, cost.source
    )
    await asyncio.gather(
        *(serve_worker(one(i), role, make, build, metrics_address) for i in range(args.count))
    )


def _with(args: argparse.Namespace, worker_id: str | None) -> argparse.Namespace:
    copy = argparse.Namespace(**vars(args))
    copy.worker_id = worker_id
    return copy
