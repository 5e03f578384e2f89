"""A worker's flags and the engine they build."""

from __future__ import annotations

import argparse
import logging

from rtp_serve.core.dtypes import resolve_dtype, resolve_kv_dtype
from rtp_serve.core.model_config import ModelConfig
from rtp_serve.engine.async_llm import AsyncLLM
from rtp_serve.engine.config import LOAD_FORMATS, SPECULATIVE_METHODS, EngineConfig
from rtp_serve.engine.cuda_graphs import LADDER
from rtp_serve.engine.memory import (
    DEFAULT_CUDA_FRACTION,
    DEFAULT_FRACTION,
    kv_budget_for_device,
    kv_bytes_per_block,
)
from rtp_serve.services.common.env import env, env_flag
from rtp_serve.services.common.flags import (
    DEFAULT_MODEL_HELP,
    add_common_flags,
    add_drain_flag,
    add_lora_flags,
    add_model_flags,
    int_or_none,
)

log = logging.getLogger(__name__)


def float_or_none(value: str | None) -> float | None:
    return None if value is None else float(value)


def kv_cache_mib(value: str) -> int | None:
    """`--kv-cache-mib`: a size in MiB, or "auto" (None: size it from the machine)."""
    if value == "auto":
        return None
    size = int(value)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of MiB or auto, got {value}")
    return size


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    add_common_flags(p)
    add_drain_flag(p, "requests in flight")
    p.add_argument("--model", default=env("model"), help=f"model directory ({DEFAULT_MODEL_HELP})")
    add_model_flags(p)
    p.add_argument(
        "--worker-id",
        default=env("worker_id"),
        help="member id, kept across restarts (e.g. a StatefulSet pod name); default: a "
        "fresh one per start. A restart under the same id is told apart by its incarnation",
    )
    p.add_argument("--device", default=env("device", "cpu"), help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--load-format",
        default=env("load_format", "auto"),
        choices=LOAD_FORMATS,
        help="auto: the checkpoint mapped on the CPU (pages shared by workers), read on a "
        "device; fastsafetensors: that package's loader (the gpu extra; GPUDirect Storage)",
    )
    p.add_argument(
        "--kv-cache-mib",
        type=kv_cache_mib,
        default=kv_cache_mib(env("kv_cache_mib", "auto")),
        help="KV cache size in MiB, or auto: memory-fraction of the available memory (a "
        "container's limit counts; on --device cuda the GPU's), split among memory-share "
        "workers, less the weights",
    )
    p.add_argument(
        "--host-kv-cache-mib",
        type=int,
        default=int(env("host_kv_cache_mib", "0")),
        help="a host-memory KV tier under the pool (T1): blocks the pool evicts spill there "
        "and are copied back up on a prefix hit; 0: none",
    )
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=float_or_none(env("memory_fraction")),
        help="with --kv-cache-mib auto: the fraction of available memory for all workers here "
        f"(default {DEFAULT_FRACTION:g} of the host's; {DEFAULT_CUDA_FRACTION:g} of a GPU's "
        "with --device cuda, less weights, activations and CUDA graphs)",
    )
    p.add_argument(
        "--memory-share",
        type=int,
        default=int(env("memory_share", "1")),
        help="with --kv-cache-mib auto: how many workers share this machine's memory",
    )
    p.add_argument("--max-num-seqs", type=int, default=int(env("max_num_seqs", "64")))
    p.add_argument(
        "--max-num-waiting",
        type=int,
        default=int(env("max_num_waiting", "256")),
        help="requests that may queue here; past it new ones are refused (RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=int(env("max_num_batched_tokens", "2048"))
    )
    p.add_argument(
        "--itl-target-ms",
        type=float,
        default=float(env("itl_target_ms", "0")),
        help="while requests decode, cap a step's prompt tokens so that its predicted time "
        "(fitted from this worker's steps) stays within this, down to the chunk its GEMMs "
        "need to run efficiently; 0: off, the token budget alone",
    )
    p.add_argument(
        "--scheduling",
        choices=("fair", "fcfs"),
        default=env("scheduling", "fair"),
        help="within a priority class: share between tenants by weighted tokens served "
        "(fair, the default), or first come, first served (fcfs)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=int(env("threads", "0")),
        help="torch threads (0: torch's default); workers sharing a machine split its cores",
    )
    p.add_argument(
        "--prefault-kv",
        action=argparse.BooleanOptionalAction,
        default=env_flag("prefault_kv", False),
        help="map the KV pool's pages in the background while the cores idle (lowest "
        "priority), so that no request pays for first-touch page faults",
    )
    p.add_argument(
        "--thread-binding",
        default=env("thread_binding", "off"),
        help="bind the engine's threads to CPUs: off (the default), auto (when the worker may "
        "run on exactly as many CPUs as it has threads: exclusive cores), or a CPU list such "
        "as 0-3 (one per thread)",
    )
    p.add_argument(
        "--speculative",
        default=env("speculative", "none"),
        choices=["none", *(m for m in SPECULATIVE_METHODS if m)],
        help="speculative decoding: ngram proposes drafts by prompt lookup (and a request's "
        "speculative_advice); draft by a draft model (--draft-model, --draft-layers); the "
        "decode side speculates in PD mode",
    )
    p.add_argument(
        "--draft-model",
        default=env("draft_model"),
        help="with --speculative draft: a smaller model with the same tokenizer (default: "
        "this model's own first --draft-layers layers)",
    )
    p.add_argument(
        "--draft-layers",
        type=int,
        default=int_or_none(env("draft_layers")),
        help="with --speculative draft: the draft model's first N layers draft (default: all "
        "of a --draft-model's; a quarter of this model's)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=int(env("num_speculative_tokens", "3")),
        help="with --speculative: draft tokens per request and step at most (adaptive below "
        "it; a request may ask for its own)",
    )

    add_lora_flags(p)


def build_llm(args: argparse.Namespace) -> AsyncLLM:
    return AsyncLLM(engine_config(args), record_kv_events=True)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the flags ask for (sizing the KV cache from the machine
    where they say auto)."""
    model = args.model
    if model is None:
        from rtp_serve.models.make_model import ensure_model

        model = str(ensure_model())
    dtype = resolve_dtype(args.dtype, model)
    if args.kv_cache_mib is None:
        cfg = ModelConfig.from_dir(model)
        # Device memory on --device cuda, host memory otherwise.
        budget = kv_budget_for_device(
            args.device,
            model,
            cfg,
            dtype,
            args.memory_fraction,
            args.memory_share,
            args.weight_dtype,
            args.max_num_batched_tokens,
            args.max_num_seqs,
            graph_rows=max(LADDER),
        )
        # No more than every sequence at full context could use.
        useful = args.max_num_seqs * cfg.max_position_embeddings
        kv_dtype = resolve_kv_dtype(dtype, args.kv_dtype)
        useful_blocks = -(-useful // args.block_size)
        kv_bytes = min(
            budget.kv_bytes, useful_blocks * kv_bytes_per_block(cfg, kv_dtype, args.block_size)
        )
        log.info(
            "KV cache size from the machine: %s%s",
            budget.describe(),
            f", capped at {useful} tokens" if kv_bytes < budget.kv_bytes else "",
        )
    else:
        kv_bytes = args.kv_cache_mib << 20
    return EngineConfig(
        model=model,
        dtype=dtype,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        device=args.device,
        load_format=args.load_format,
        block_size=args.block_size,
        kv_cache_memory_bytes=kv_bytes,
        host_kv_cache_bytes=args.host_kv_cache_mib << 20,
        max_num_seqs=args.max_num_seqs,
        max_num_waiting=args.max_num_waiting,
        max_num_batched_tokens=args.max_num_batched_tokens,
        itl_target_ms=args.itl_target_ms,
        fair_scheduling=args.scheduling == "fair",
        num_threads=args.threads or None,
        thread_binding=args.thread_binding,
        prefault_kv=args.prefault_kv,
        speculative=None if args.speculative == "none" else args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model if args.speculative == "draft" else None,
        draft_num_layers=args.draft_layers if args.speculative == "draft" else None,
        loras=tuple(args.loras),
        max_loras=args.max_loras,
    )
