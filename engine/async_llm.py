"""The async engine the workers wrap: `generate()` is an async iterator of outputs.

The engine loop runs on its own thread and owns all engine state. Callers talk to it only
through a command queue (add, abort, call), and outputs come back to each caller's event
loop with `call_soon_threadsafe`, so the model's matmuls never block an asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import PromptKV, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SampledToken

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


@dataclass(slots=True)
class _Add:
    request: Request
    stream: _Stream


@dataclass(slots=True)
class _Activate:
    request_id: str
    kv: list[PromptKV]
    first: SampledToken
    stream: _Stream


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future


class AsyncLLM:
    def __init__(self, config: EngineConfig, record_kv_events: bool = False) -> None:
        self.engine = LLMEngine(config, record_kv_events=record_kv_events)
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.SimpleQueue[_Add | _Activate | _Abort | _Call | None] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- caller side (any thread, any event loop) ------------------------------------------
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        export_kv_from: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs until the request finishes. Closing the iterator aborts it.

        With `export_kv_from` (PD prefill side) the final output carries the prompt's KV.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        request = self.engine.make_request(request_id, prompt, params, priority, export_kv_from)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(_Add(request, stream))
        async for out in self._consume(request_id, stream):
            yield out

    async def reserve(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, priority: int = 0
    ) -> int:
        """PD decode side: hold blocks for a prompt computed elsewhere.

        Returns how many leading prompt tokens are cached here already. Raises ValueError
        for bad input and engine.scheduler.NoCapacityError when there is no room.
        """
        request = self.engine.make_request(request_id, prompt, params, priority)
        return await self.call(lambda engine: engine.reserve(request))

    async def generate_prefilled(
        self, request_id: str, kv: Sequence[PromptKV], first: SampledToken
    ) -> AsyncIterator[RequestOutput]:
        """Write a reserved request's prompt KV, then decode on from the first token."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(_Activate(request_id, list(kv), first, stream))
        async for out in self._consume(request_id, stream):
            yield out

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
        """Run `fn(engine)` on the engine thread between steps (integrity checks, stats)."""
        future: Future = Future()
        self._inbox.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (no locking needed to read it)."""
        return self._stats

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join()

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            # Block for commands only when there is nothing to compute.
            try:
                cmd = self._inbox.get(block=not engine.has_unfinished_requests())
                while True:
                    if cmd is None:
                        self._fail_all(RuntimeError("engine shut down"))
                        return
                    self._handle(cmd)
                    cmd = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug or OOM in a step must not strand callers
                log.exception("engine step failed; aborting %d requests", len(self._streams))
                self._fail_all(exc)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
                    if out.finished:
                        del self._streams[out.request_id]
            self._stats = engine.stats()

    def _handle(self, cmd: _Add | _Activate | _Abort | _Call) -> None:
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.request)
            except ValueError as exc:
                cmd.stream.put(exc)
                return
            self._streams[cmd.request.request_id] = cmd.stream
        elif isinstance(cmd, _Activate):
            try:
                for part in cmd.kv:
                    self.engine.write_prompt_kv(cmd.request_id, part.start, part.k, part.v)
                out = self.engine.activate(cmd.request_id, cmd.first)
            except (KeyError, ValueError) as exc:
                self.engine.abort_request(cmd.request_id)
                cmd.stream.put(ValueError(f"cannot activate {cmd.request_id}: {exc}"))
                return
            cmd.stream.put(out)
            if not out.finished:
                self._streams[cmd.request_id] = cmd.stream
        elif isinstance(cmd, _Abort):
            out = self.engine.abort_request(cmd.request_id)
            stream = self._streams.pop(cmd.request_id, None)
            if out is not None and stream is not None:
                stream.put(out)
        else:
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
