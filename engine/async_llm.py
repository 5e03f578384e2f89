"""The async engine the workers wrap: `generate()` is an async iterator of outputs.

The engine loop runs on its own thread and owns all engine state. Callers talk to it only
through a command queue (add, deliver KV, abort, call), and outputs come back to each
caller's event loop with `call_soon_threadsafe`, so the model's matmuls never block an
asyncio loop. The one read from the caller's thread is `cached_prefix`: a queued command is
answered only between steps, and a step of a burst's prefill takes seconds.

This class is the whole interface between the workers and the engine: what a service needs
(block size, KV layout, cache salt, KV events, tier lookups, stats and checks) is here, and
no service reaches past it into `LLMEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rtp_serve.core.block_hash import BlockHash
from rtp_serve.core.cost_model import CostModel, StepCost
from rtp_serve.core.outputs import SampledToken
from rtp_serve.core.peft_config import LoraConfig
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.tenant import DEFAULT_SHARE, TenantShare
from rtp_serve.engine.block_pool import KVEvent
from rtp_serve.engine.config import EngineConfig, KVLayout
from rtp_serve.engine.errors import EngineStoppedError, QueueFullError
from rtp_serve.engine.kv_export import KVExport
from rtp_serve.engine.llm_engine import LLMEngine
from rtp_serve.engine.lora.registry import LoraStats
from rtp_serve.engine.outputs import PromptKV, RequestOutput, StagedKV
from rtp_serve.engine.request import Request
from rtp_serve.engine.stats import EngineCheck, EngineStats
from rtp_serve.kernels import affinity, cpu

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        # A closed caller loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _deliver(
    items: list[tuple[asyncio.Queue, RequestOutput]], then: Callable[[], None] | None = None
) -> None:
    """On a caller's loop: one step's outputs into their streams' queues, in step order;
    then `then` (a KV-event watcher told in the same wake-up)."""
    for q, item in items:
        q.put_nowait(item)
    if then is not None:
        then()


@dataclass(slots=True)
class _Add:
    request: Request
    stream: _Stream
    held: bool = False
    tokens: int = 0  # its prompt tokens the engine will compute (none for remote prefill)


@dataclass(slots=True)
class _Release:
    request_id: str
    staged: StagedKV | None


@dataclass(slots=True)
class _DeliverKV:
    request_id: str
    kv: list[PromptKV]
    first: SampledToken


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future


class AsyncLLM:
    def __init__(self, config: EngineConfig, record_kv_events: bool = False) -> None:
        self.config = config
        self.model = config.model
        self.block_size = config.block_size
        self.max_num_waiting = config.max_num_waiting
        self.max_num_seqs = config.max_num_seqs
        self._inbox: queue.SimpleQueue[_Add | _Release | _DeliverKV | _Abort | _Call | None] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        # Who to tell that KV events wait (watch_kv_events), and whether it was told since
        # they were last taken (the engine thread's alone).
        self._kv_watch: tuple[asyncio.AbstractEventLoop, Callable[[], None]] | None = None
        self._kv_told = False
        # Requests (and their prompt tokens) given to the engine thread that it has not
        # taken yet: it takes commands between steps, so what arrives during a step waits
        # for it to end. Each counter has one writer (sent: the callers' loop, taken: the
        # engine thread); stats() counts the difference as waiting.
        self._sent = (0, 0)  # (requests, tokens); replaced whole, so read whole
        self._taken = (0, 0)
        # The engine is built on the thread that runs it, so that the model's torch work at
        # load (weights, kernel tables) and in every step comes from one thread. Each thread
        # that runs a parallel region keeps an OpenMP team of its own; with the loader's
        # team idle beside the engine's, libgomp counts more threads than cores and stops
        # spinning between regions, and a step on the engine thread took longer than the
        # same step on the thread that loaded the model (1.05-1.11x, medians of
        # bench/omp_teams.py on 2 cores; built here, 0.92-1.01x).
        self._built: Future[LLMEngine] = Future()
        # The CPUs the engine's threads are bound to, thread by thread (None: the OS places
        # them); set on the engine thread before the build.
        self.bound_cpus: list[int] | None = None
        self._thread = threading.Thread(
            target=self._build_and_run, args=(config, record_kv_events), name="engine-loop",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        self.engine = self._built.result()  # what the build raised, raised here
        self.kv_layout: KVLayout = self.engine.kv_layout
        self.cache_salt: bytes = self.engine.cache_salt
        # What the worker runs on, for Stats: the CPU's ISA level and the kernels it chose
        # (projections, attention: rtp_serve/kernels/backends.py).
        self.cpu_isa: str = self.engine.runner.cpu_isa
        self.linear_kernels: str = self.engine.runner.linear_kernels
        self.attention_backend: str = self.engine.runner.attention_backend
        self.tokenizer = self.engine.tokenizer
        self._stats = self.engine.stats()  # the engine thread waits for its first command

    # -- caller side (any thread, any event loop) ------------------------------------------
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        *,
        export_kv_from: int | None = None,
        export_kv: KVExport = KVExport.PROMPT,
        remote_prefill: bool = False,
        block_hashes: list[BlockHash] | None = None,
        lora: str = "",
        tenant: TenantShare = DEFAULT_SHARE,
        prefetch: Callable[[], Awaitable[StagedKV | None]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream output deltas until the request finishes. Closing the iterator aborts it.

        `export_kv_from`: the final output carries the prompt's KV from there, the part
        `export_kv` says (engine/kv_export.py; None if that is empty).
        `remote_prefill` (PD decode side): once blocks are reserved, an output with
        `waiting_for_kv` (and the prompt tokens cached here) comes first; the request then
        waits for `deliver_kv`. `block_hashes`: the prompt's keys, when the caller has them.
        `lora`: the adapter to run under ("" the base model). `tenant`: whom it is served
        for (the scheduler shares each priority class between tenants). `prefetch`: fetches the
        prompt's prefix from a lower tier; it runs while the request is queued (which keeps
        its place, but is admitted only once the fetch is over; a failed fetch is a miss).
        Raises ValueError for bad input, UnknownAdapterError for an adapter not served,
        QueueFullError when max_num_waiting requests wait.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        request = self.engine.make_request(
            request_id,
            prompt,
            params,
            priority,
            export_kv_from=export_kv_from,
            export_kv=export_kv,
            remote_prefill=remote_prefill,
            block_hashes=block_hashes,
            lora=lora,
            tenant=tenant,
        )
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        tokens = 0 if remote_prefill else request.num_prompt_tokens  # as stats() counts
        self._sent = (self._sent[0] + 1, self._sent[1] + tokens)
        self._inbox.put(_Add(request, stream, held=prefetch is not None, tokens=tokens))
        # Created after the _Add is queued, so the engine sees the release after the add.
        fetch = asyncio.create_task(self._prefetch(request_id, prefetch)) if prefetch else None
        try:
            async for out in self._consume(request_id, stream):
                yield out
        finally:
            if fetch is not None:
                fetch.cancel()

    async def _prefetch(
        self, request_id: str, prefetch: Callable[[], Awaitable[StagedKV | None]]
    ) -> None:
        try:
            staged = await prefetch()
        except Exception:  # a lower tier is an optimisation: failing, it is a miss
            log.warning("prefix fetch for %s failed; computing it", request_id, exc_info=True)
            staged = None
        self._inbox.put(_Release(request_id, staged))

    def deliver_kv(self, request_id: str, kv: Sequence[PromptKV], first: SampledToken) -> None:
        """Hand a `remote_prefill` request its prompt KV and first token; its stream goes on
        (or ends with a ValueError if the KV does not fit the request)."""
        self._inbox.put(_DeliverKV(request_id, list(kv), first))

    async def _consume(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    # Refused (e.g. a duplicate id) or already aborted by the engine: aborting
                    # by id now could only hit another caller's request of the same id.
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (tests and tools)."""
        future: Future = Future()
        self._inbox.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def salt_for(self, lora: str = "") -> bytes:
        """The block-hash salt of requests under `lora` (UnknownAdapterError if not served)."""
        return self.engine.adapters.salt_for(lora)

    async def add_lora(self, name: str, path: str) -> LoraStats:
        """Serve the PEFT adapter in `path` as `name` (AdapterError, ValueError)."""
        config = await asyncio.to_thread(LoraConfig.load, name, path)  # reads and hashes
        return await self.call(
            lambda engine: (engine.adapters.add(config), engine.adapters.stats())[1]
        )

    async def remove_lora(self, name: str) -> LoraStats:
        """Stop serving `name` (UnknownAdapterError; ValueError while requests use it)."""
        return await self.call(
            lambda engine: (engine.adapters.remove(name), engine.adapters.stats())[1]
        )

    def lora_stats(self) -> LoraStats:
        """As of the latest step (the engine thread's snapshot)."""
        loras = self._stats.loras
        assert loras is not None
        return loras

    def cached_prefix(self, block_hashes: list[BlockHash]) -> int:
        """How many leading blocks of these keys the device pool or the host tier holds, read
        now from this thread (dict lookups, safe beside the engine thread), not between steps:
        a request's tier lookup (services/worker/tiers.py) then ends, and it is released for
        admission, within the step it arrived in instead of one or two steps later."""
        return self.engine.tiers.peek_cached_prefix(block_hashes)

    def kv_events_pending(self) -> bool:
        """Whether take_kv_events would return events, read now from this thread without
        waking the engine (lists' truth, safe beside it). An event recorded just after the
        read is seen by the next one: a caller that polls takes only when this says so."""
        return self.engine.tiers.has_events()

    def watch_kv_events(self, callback: Callable[[], None]) -> None:
        """Call `callback` on this event loop when the engine has recorded KV events, once
        until take_kv_events (or kv_snapshot) takes them: a feed then sleeps until there is
        something to publish instead of looking 20 times a second. The call rides in the
        wake-up that brings the step's outputs to this loop when there is one."""
        self._kv_watch = (asyncio.get_running_loop(), callback)
        self._inbox.put(_Call(lambda engine: self._hand_out(engine, {}), Future()))  # any waiting

    async def take_kv_events(self) -> list[KVEvent]:
        """Prefix-cache stored/removed events since the previous call (record_kv_events)."""
        return await self.call(self._take_kv_events)

    def _take_kv_events(self, engine: LLMEngine) -> list[KVEvent]:
        self._kv_told = False  # on the engine thread, as every step's telling
        return engine.tiers.take_events()

    async def kv_snapshot(
        self,
    ) -> tuple[list[KVEvent], tuple[list[BlockHash], list[BlockHash]]]:
        """The pending events (as take_kv_events) and every hash the device pool and the
        host tier hold after them, taken together between steps: the hashes are exactly
        what applying all events taken so far gives."""
        return await self.call(
            lambda engine: (self._take_kv_events(engine), engine.tiers.cached_hashes())
        )

    async def check(self) -> EngineCheck:
        """Stats, held blocks and the integrity check, taken between steps."""
        return await self.call(lambda engine: engine.check())

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step or command, with the requests sent
        since and not taken yet counted as waiting (no locking needed to read it)."""
        stats, (sent, sent_tokens), (taken, taken_tokens) = self._stats, self._sent, self._taken
        if sent <= taken:  # (taken can pass a `sent` read just before it)
            return stats
        return dataclasses.replace(
            stats,
            num_waiting=stats.num_waiting + sent - taken,
            num_queued_tokens=stats.num_queued_tokens + max(0, sent_tokens - taken_tokens),
        )

    def step_cost(self) -> StepCost:
        """The step-time model fitted over the recent steps (an immutable snapshot). Under
        an ITL target its token budget is the prompt chunk a step takes beside the requests
        running now: what a wait predicted from it (here, in Stats and load reports, and
        by the master from the report) has to be chunked by."""
        cost = self.engine.costs.step()
        cap = self.engine.prompt_cap(self._stats.num_running)
        if cap is not None and (not cost.token_budget or cap < cost.token_budget):
            cost = dataclasses.replace(cost, token_budget=cap)
        return cost

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block (what a tier fetch moves per block)."""
        return self.engine.limits.bytes_per_block

    @property
    def costs(self) -> CostModel:
        """The engine's fitted step and fetch times (thread-safe)."""
        return self.engine.costs

    def shutdown(self) -> None:
        """Stop the engine thread; unfinished requests end with EngineStoppedError."""
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join()
        self.engine.runner.close()

    # -- engine thread ---------------------------------------------------------------------
    def _build_and_run(self, config: EngineConfig, record_kv_events: bool) -> None:
        # Named before the build's first parallel region starts the OpenMP team, which
        # takes the name: the model's threads, told apart from the caller's (top -H).
        affinity.name_thread(affinity.ENGINE_THREAD)
        try:
            self.bound_cpus = _bind_threads(config)
            engine = LLMEngine(config, record_kv_events=record_kv_events)
        except BaseException as exc:
            self._built.set_exception(exc)
            return
        self._built.set_result(engine)
        self._run(engine)

    def _run(self, engine: LLMEngine) -> None:
        while True:
            # Block for commands only when there is nothing to compute.
            try:
                cmd = self._inbox.get(block=not engine.has_schedulable_requests())
                while True:
                    if cmd is None:
                        self._fail_all(EngineStoppedError("engine shut down"))
                        return
                    self._handle(cmd)
                    cmd = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if not engine.has_schedulable_requests():
                self._hand_out(engine, {})  # a command's events (a KV delivery, an abort)
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug or OOM in a step must not strand callers
                log.exception("engine step failed; aborting %d requests", len(self._streams))
                self._fail_all(exc)
                continue
            # One hand-off per caller loop per step, not one per request: each
            # call_soon_threadsafe wakes the loop through its self-pipe (a syscall and a
            # loop iteration), which at a batch of 64 cost the loop more than the tokens.
            batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.queue, out))
                    if out.finished:
                        del self._streams[out.request_id]
            self._hand_out(engine, batches)
            self._stats = engine.stats()

    def _hand_out(
        self,
        engine: LLMEngine,
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]],
    ) -> None:
        """Hand each caller loop its outputs, and the KV-event watcher its news if events
        wait and it was not told yet: with its loop's outputs where it has some."""
        told = None
        watch = self._kv_watch
        if watch is not None and not self._kv_told and engine.tiers.has_events():
            self._kv_told, told = True, watch
            batches.setdefault(watch[0], [])
        for loop, items in batches.items():
            then = told[1] if told is not None and loop is told[0] else None
            with contextlib.suppress(RuntimeError):  # a closed caller loop: nobody listens
                loop.call_soon_threadsafe(_deliver, items, then)

    def _handle(self, cmd: _Add | _Release | _DeliverKV | _Abort | _Call) -> None:
        if isinstance(cmd, _Add):
            self._taken = (self._taken[0] + 1, self._taken[1] + cmd.tokens)
            try:
                self.engine.add_request(cmd.request, cmd.held)
            except (ValueError, QueueFullError) as exc:
                cmd.stream.put(exc)
                return
            self._streams[cmd.request.request_id] = cmd.stream
        elif isinstance(cmd, _Release):
            self.engine.release_request(cmd.request_id, cmd.staged)
        elif isinstance(cmd, _DeliverKV):
            stream = self._streams.get(cmd.request_id)
            if stream is None:
                return  # aborted meanwhile
            try:
                out = self.engine.write_remote_kv(cmd.request_id, cmd.kv, cmd.first)
            except ValueError as exc:
                self.engine.abort_request(cmd.request_id)
                del self._streams[cmd.request_id]
                stream.put(ValueError(f"cannot take the KV of {cmd.request_id}: {exc}"))
                return
            stream.put(out)
            if out.finished:
                del self._streams[cmd.request_id]
        elif isinstance(cmd, _Abort):
            out = self.engine.abort_request(cmd.request_id)
            stream = self._streams.pop(cmd.request_id, None)
            if out is not None and stream is not None:
                stream.put(out)
        elif cmd.future.set_running_or_notify_cancel():
            # (A call whose caller was cancelled meanwhile is skipped: nobody waits for it,
            # and setting its result would raise here and stop the engine thread.)
            try:
                cmd.future.set_result(cmd.fn(self.engine))
            except Exception as exc:
                cmd.future.set_exception(exc)
        self._stats = self.engine.stats()

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(exc)
        self._streams.clear()


def _bind_threads(config: EngineConfig) -> list[int] | None:
    """On the engine thread, before the build: its thread count, and its team bound to CPUs
    as `config.thread_binding` says (rtp_serve/kernels/affinity.py)."""
    if config.device != "cpu" or config.thread_binding == "off":
        return None
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    return affinity.bind_threads(config.thread_binding, torch.get_num_threads(), cpu.load())
