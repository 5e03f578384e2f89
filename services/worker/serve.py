"""A worker process's life: engine, gRPC server, registration with the nameservice, event
publishing, and a clean stop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from rtp_serve.core.block_hash import model_fingerprint
from rtp_serve.core.dtypes import kv_numerics
from rtp_serve.services.common import grpc_util, metrics
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.flags import advertised
from rtp_serve.services.common.heap import keep_freed_memory
from rtp_serve.services.common.kv_namespace import KVNamespace
from rtp_serve.services.common.naming import NameClient, make_member
from rtp_serve.services.common.pb import nameservice_pb2, worker_pb2_grpc
from rtp_serve.services.worker import metrics as worker_metrics
from rtp_serve.services.worker.kv_events import KVEventFeed, publish_events
from rtp_serve.services.worker.servicer import WorkerServicer

if TYPE_CHECKING:
    from rtp_serve.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)
STOP_GRACE_S = 0.5  # after the drain: for the calls just ended to send their status


async def serve_worker(
    args: argparse.Namespace,
    role: int,
    make_servicer: Callable[[AsyncLLM, argparse.Namespace], WorkerServicer],
    build_llm: Callable[[argparse.Namespace], AsyncLLM] | None = None,
    metrics_address: str | None = None,
) -> None:
    """Run one worker until cancelled: engine, gRPC server, registration, event publishing.

    `build_llm`: the engine (default: the torch engine the flags describe; the simulated
    worker passes its own). `metrics_address`: a metrics server already serving this
    process (several workers in one process share one), else one is started here."""
    if build_llm is None:
        from rtp_serve.services.worker.config import build_llm
    keep_freed_memory()  # KV moves through buffers of megabytes (services/common/heap.py)
    llm = await asyncio.to_thread(build_llm, args)
    server, port, health = grpc_util.create_server(f"{args.host}:{args.port}")
    servicer = make_servicer(llm, args)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    address = advertised(args, port)
    if metrics_address is None:
        metrics_port = metrics.start_metrics_server(args.metrics_port, args.host)
        metrics_address = advertised(args, metrics_port)
    member = make_member(
        role,
        address,
        model=llm.model,
        capacity=args.max_num_seqs,
        metrics_address=metrics_address,
        member_id=args.worker_id,
        kv=await asyncio.to_thread(kv_namespace, llm),
    )
    member.streams = servicer.serves_streams  # callers then send our requests over one call
    bus = await Bus.connect(args.nats_url, member.id, args.nats_token)
    feed = KVEventFeed(llm, bus, member.id, args.namespace)
    servicer.serve_snapshots(feed)
    names = NameClient(args.nameservice) if args.nameservice else None
    load_metrics = worker_metrics.worker(role, llm.model)
    load_metrics.kv_capacity(llm.stats().num_total_blocks, llm.block_size)
    remote = servicer.tiers is not None and servicer.tiers.remote
    publisher = asyncio.create_task(publish_events(feed, args.namespace, load_metrics, remote))
    background = asyncio.create_task(servicer.background(names))
    await server.start()
    await grpc_util.set_serving(health, "rtp.v1.Worker", True)
    try:
        if names is not None:
            await _register(names, member)
        log.info(
            "worker ready role=%s id=%s incarnation=%d address=%s pid=%d",
            nameservice_pb2.Role.Name(role),
            member.id,
            feed.incarnation,
            address,
            os.getpid(),
        )
        # Until cancelled (SIGTERM). The publisher runs as long, and the role's background
        # work (if any) too: one that fails ends the worker, which must not serve on with
        # its load and KV events no longer reaching the master, or its role's work undone.
        await asyncio.wait([publisher, background], return_when=asyncio.FIRST_EXCEPTION)
        failed = publisher if publisher.done() else background
        what = "load and KV-event publishing" if failed is publisher else "background work"
        raise RuntimeError(f"{what} failed") from failed.exception()
    finally:
        await _drain(servicer, names, health, args.drain_timeout)
        publisher.cancel()
        background.cancel()
        # Calls still running end UNAVAILABLE (EngineStoppedError): callers resume elsewhere.
        await asyncio.to_thread(llm.shutdown)
        await server.stop(grace=STOP_GRACE_S)
        await bus.close()


def kv_namespace(llm: AsyncLLM) -> KVNamespace:
    """The KV namespace this worker registers: its engine's block size and cache salt."""
    cfg = llm.config
    numerics = kv_numerics(cfg.dtype, cfg.weight_dtype, cfg.kv_dtype)
    kv = KVNamespace(llm.block_size, model_fingerprint(llm.model).hex(), numerics)
    if kv.cache_salt != llm.salt_for():  # the engine salts alike; a guard against drift
        raise RuntimeError("the registered cache salt differs from the engine's")
    return kv


async def _register(names: NameClient, member: nameservice_pb2.Member) -> None:
    """Register; a worker the nameservice refuses (another KV namespace than the model's
    other workers) must not serve: it logs why and exits non-zero."""
    try:
        await names.register(member)
    except grpc.aio.AioRpcError as exc:
        log.error("the nameservice refused this worker (%s): %s", exc.code().name, exc.details())
        raise SystemExit(1) from exc


async def _drain(
    servicer: WorkerServicer, names: NameClient | None, health, timeout: float
) -> None:
    """Refuse new calls, leave the nameservice (nothing new is routed here), and give the
    calls in flight up to `timeout` seconds to finish."""
    started = time.monotonic()
    servicer.drain.begin()
    await grpc_util.set_serving(health, "rtp.v1.Worker", False)
    if names is not None:
        with contextlib.suppress(Exception):
            await names.close()
    in_flight = servicer.drain.in_flight
    finished = await servicer.drain.wait(max(0.0, started + timeout - time.monotonic()))
    log.info(
        "drained %d calls in flight in %.2f s%s",
        in_flight,
        time.monotonic() - started,
        "" if finished else f"; ending the {servicer.drain.in_flight} left",
    )
