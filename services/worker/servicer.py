"""The base of every worker role's servicer: the Stats and Snapshot RPCs, and engine
refusals as gRPC statuses."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from rtp_serve.core.peft_config import UnknownAdapterError
from rtp_serve.engine.errors import EngineStoppedError, QueueFullError
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.naming import NameClient
from rtp_serve.services.common.pb import worker_pb2, worker_pb2_grpc
from rtp_serve.services.worker.drain import Drain
from rtp_serve.services.worker.kv_events import KVEventFeed
from rtp_serve.services.worker.metrics import WorkerMetrics
from rtp_serve.services.worker.tiers import Tiers

if TYPE_CHECKING:
    from rtp_serve.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


class PeerUnavailableError(RuntimeError):
    """Another worker this request depends on (the prefill side, at `address`) failed or
    went away."""

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message)
        self.address = address


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Answers Stats (used by tests and operators to prove no blocks leak) and Snapshot (the
    master's index resync, once `serve_snapshots` gave it the event feed); a role adds its
    RPCs (the others answer UNIMPLEMENTED)."""

    serves_streams = False  # Worker.Streams (a role with Generate has it: Member.streams)

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.drain = Drain()  # a role's streaming RPCs go through drain.guard
        self._feed: KVEventFeed | None = None
        self.tiers: Tiers | None = None  # the KV tiers below the pool, for roles that read them
        self.metrics: WorkerMetrics | None = None  # a role's, once it has made them

    def serve_snapshots(self, feed: KVEventFeed) -> None:
        """Answer Snapshot from `feed` (the member id it carries exists only after the
        servicer, so this comes after construction)."""
        self._feed = feed

    async def Snapshot(
        self, request: worker_pb2.KVSnapshotRequest, context
    ) -> worker_pb2.KVSnapshot:
        if self._feed is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker not started yet")
        return await self._feed.snapshot()

    async def background(self, names: NameClient | None) -> None:
        """Work a role runs beside its RPCs for the worker's lifetime (cancelled at exit)."""

    async def Stats(
        self, request: worker_pb2.WorkerStatsRequest, context
    ) -> worker_pb2.WorkerStats:
        check = await self.llm.check()
        stats = check.stats
        cost = self.llm.step_cost()
        return worker_pb2.WorkerStats(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            free_blocks=stats.num_free_blocks,
            total_blocks=stats.num_total_blocks,
            held_blocks=check.num_held_blocks,
            integrity_ok=not check.integrity_error,
            integrity_error=check.integrity_error,
            block_size=self.llm.block_size,
            queued_tokens=stats.num_queued_tokens,
            queue_wait_s=cost.queue_wait_s(stats.num_queued_tokens, stats.num_running),
            prefill_tokens_per_s=cost.prefill_tokens_per_s,
            decode_step_s=cost.decode_step_s(stats.num_running),
            max_num_waiting=self.llm.max_num_waiting,
            dtype=self.llm.config.dtype,
            weight_dtype=self.llm.config.weight_dtype,
            kv_dtype=self.llm.kv_layout.dtype,
            cpu_isa=self.llm.cpu_isa,
            linear_kernels=self.llm.linear_kernels,
            attention_backend=self.llm.attention_backend,
            loras=stats.loras.known if stats.loras else (),
            resident_loras=stats.loras.resident if stats.loras else (),
            kv_transfers_in_flight=self.metrics.transfers_in_flight if self.metrics else 0,
        )

    async def LoadLoraAdapter(
        self, request: worker_pb2.LoadLoraRequest, context
    ) -> worker_pb2.LoraReply:
        try:
            stats = await self.llm.add_lora(request.lora_name, request.lora_path)
        except (ValueError, LookupError) as exc:
            await context.abort(*abort_status(exc))
        log.info("LoRA adapter %s loaded from %s", request.lora_name, request.lora_path)
        return worker_pb2.LoraReply(loras=stats.known)

    async def UnloadLoraAdapter(
        self, request: worker_pb2.UnloadLoraRequest, context
    ) -> worker_pb2.LoraReply:
        try:
            stats = await self.llm.remove_lora(request.lora_name)
        except ValueError as exc:  # still in use
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except LookupError as exc:
            await context.abort(*abort_status(exc))
        log.info("LoRA adapter %s unloaded", request.lora_name)
        return worker_pb2.LoraReply(loras=stats.known)


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status for `exc`, naming the failed peer if a peer failed."""
    if isinstance(exc, PeerUnavailableError):
        context.set_trailing_metadata(((grpc_util.FAILED_PEER_KEY, exc.address),))
    code, message = abort_status(exc)
    await context.abort(code, message)


def abort_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an engine-side refusal."""
    if isinstance(exc, EngineStoppedError):
        return grpc.StatusCode.UNAVAILABLE, "worker shut down before the request finished"
    if isinstance(exc, PeerUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)  # the caller may route elsewhere
    if isinstance(exc, UnknownAdapterError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)  # full: another worker may not be
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
