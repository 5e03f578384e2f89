"""What every worker process (prefill, decode, fused) does besides serving its RPCs.

It owns the AsyncLLM, registers with the nameservice, publishes the engine's prefix-cache
changes (rtp.v1.KVEvents) and its load (rtp.v1.LoadReport) on NATS at a bounded rate, and
answers the Stats RPC (used by tests and operators to prove no blocks leak).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

import grpc

from engine.async_llm import AsyncLLM
from engine.block_pool import KVEventKind
from engine.config import EngineConfig
from services.common import grpc_util, metrics, subjects
from services.common.bus import Bus
from services.common.flags import DEFAULT_MODEL_HELP, add_common_flags, advertised, env
from services.common.naming import NameClient, make_member
from services.common.pb import events_pb2, nameservice_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

EVENT_INTERVAL_S = 0.05  # KV events: at most 20 messages a second
LOAD_INTERVAL_S = 0.25


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


class StatsServicer(worker_pb2_grpc.WorkerServicer):
    """Base of every role's servicer: the Stats RPC (other RPCs answer UNIMPLEMENTED)."""

    llm: AsyncLLM

    async def background(self, names: NameClient | None) -> None:
        """Work a role runs beside its RPCs for the worker's lifetime (cancelled at exit)."""

    async def Stats(
        self, request: worker_pb2.WorkerStatsRequest, context
    ) -> worker_pb2.WorkerStats:
        def snapshot(engine) -> worker_pb2.WorkerStats:
            stats = engine.stats()
            held = sum(1 for b in engine.pool.blocks if b.ref_cnt > 0)
            error = ""
            try:
                engine.check_integrity()
            except AssertionError as exc:
                error = str(exc) or "integrity check failed"
            return worker_pb2.WorkerStats(
                num_waiting=stats.num_waiting,
                num_running=stats.num_running,
                free_blocks=stats.num_free_blocks,
                total_blocks=stats.num_total_blocks,
                held_blocks=held,
                integrity_ok=not error,
                integrity_error=error,
            )

        return await self.llm.call(snapshot)


async def publish_events(
    llm: AsyncLLM,
    bus: Bus,
    worker_id: str,
    namespace: str,
    load_metrics: metrics.WorkerMetrics | None = None,
) -> None:
    """Forward the engine's stored/removed block events and load, at a bounded rate; the
    load also goes to `load_metrics` (the Prometheus gauges)."""
    seq = 0
    last_load = 0.0
    kv_subject = subjects.kv_events(worker_id, namespace)
    load_subject = subjects.load_report(worker_id, namespace)
    block_size = llm.engine.config.block_size
    while True:
        await asyncio.sleep(EVENT_INTERVAL_S)
        events = await llm.call(lambda engine: engine.pool.take_events())
        if events:
            # Net the batch: only each hash's last event counts (stored then evicted = gone).
            last = {event.block_hash: event.kind for event in events}
            seq += 1
            msg = events_pb2.KVEvents(
                worker_id=worker_id,
                seq=seq,
                stored=[h for h, kind in last.items() if kind == KVEventKind.STORED],
                removed=[h for h, kind in last.items() if kind == KVEventKind.REMOVED],
            )
            await bus.publish(kv_subject, msg)
        now = time.monotonic()
        if now - last_load >= LOAD_INTERVAL_S:
            last_load = now
            s = llm.stats()
            if load_metrics is not None:
                load_metrics.load(
                    s.num_running, s.num_waiting, s.num_free_blocks, s.num_total_blocks
                )
            await bus.publish(
                load_subject,
                events_pb2.LoadReport(
                    worker_id=worker_id,
                    num_waiting=s.num_waiting,
                    num_running=s.num_running,
                    free_blocks=s.num_free_blocks,
                    total_blocks=s.num_total_blocks,
                    queued_tokens=s.num_queued_tokens,
                    block_size=block_size,
                    unix_ms=int(time.time() * 1000),
                ),
            )


async def serve_worker(
    args: argparse.Namespace,
    role: int,
    make_servicer: Callable[[AsyncLLM, argparse.Namespace], StatsServicer],
) -> None:
    """Run one worker until cancelled: engine, gRPC server, registration, event publishing."""
    llm = await asyncio.to_thread(build_llm, args)
    server, port, health = grpc_util.create_server(f"{args.host}:{args.port}")
    servicer = make_servicer(llm, args)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    address = advertised(args, port)
    metrics_port = metrics.start_metrics_server(args.metrics_port, args.host)
    member = make_member(
        role,
        address,
        model=llm.engine.config.model,
        capacity=args.max_num_seqs,
        metrics_address=advertised(args, metrics_port),
    )
    bus = await Bus.connect(args.nats_url, member.id)
    names = NameClient(args.nameservice) if args.nameservice else None
    load_metrics = metrics.worker(role, llm.engine.config.model)
    publisher = asyncio.create_task(
        publish_events(llm, bus, member.id, args.namespace, load_metrics)
    )
    background = asyncio.create_task(servicer.background(names))
    await server.start()
    await grpc_util.set_serving(health, "rtp.v1.Worker", True)
    try:
        if names is not None:
            await names.register(member)
        log.info(
            "worker ready role=%s id=%s address=%s pid=%d",
            nameservice_pb2.Role.Name(role),
            member.id,
            address,
            os.getpid(),
        )
        await asyncio.Event().wait()  # until cancelled (SIGTERM)
    finally:
        await grpc_util.set_serving(health, "rtp.v1.Worker", False)
        if names is not None:
            with contextlib.suppress(Exception):
                await names.close()
        publisher.cancel()
        background.cancel()
        await server.stop(grace=2.0)
        await bus.close()
        llm.shutdown()


class PeerUnavailableError(RuntimeError):
    """Another worker this request depends on (the prefill side) failed or went away."""


def abort_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an engine-side refusal."""
    from engine.scheduler import NoCapacityError

    if isinstance(exc, PeerUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)  # the caller may route elsewhere
    if isinstance(exc, NoCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
