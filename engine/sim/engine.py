"""SimLLM: what the workers' serving code uses of AsyncLLM, over the simulated scheduler.

The step loop is a task on the caller's event loop (started by the first request), so many
simulated engines share one process and one loop: an idle one costs nothing, a busy one
sleeps each step for the time the cost profile gives it (or, with `SimConfig.step` "burn",
spends that time on a core: engine/sim/cpu_burn.py). Commands (add, abort, KV delivery)
run at once on the loop, between steps; a step's outputs go out when its time has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from rtp_serve.core.block_hash import BlockHash, block_hash_keys, model_fingerprint, salt_of
from rtp_serve.core.cost_model import CostModel, StepCost
from rtp_serve.core.dtypes import kv_numerics
from rtp_serve.core.model_config import ModelConfig
from rtp_serve.core.outputs import SampledToken
from rtp_serve.core.peft_config import UnknownAdapterError
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.sim_cost import SimCost
from rtp_serve.core.tenant import DEFAULT_SHARE, TenantShare
from rtp_serve.core.validation import check_prompt
from rtp_serve.engine.block_pool import BlockPool, KVEvent
from rtp_serve.engine.config import KVLayout
from rtp_serve.engine.errors import EngineStoppedError
from rtp_serve.engine.kv_export import KVExport
from rtp_serve.engine.outputs import PromptKV, RequestOutput, StagedKV
from rtp_serve.engine.sim.cpu_burn import burn
from rtp_serve.engine.sim.scheduler import SimRequest, SimScheduler, Work
from rtp_serve.engine.stats import EngineCheck, EngineStats

log = logging.getLogger(__name__)
# KV on the wire: one float32 per token for K and V (what a simulated transfer moves).
SIM_KV_LAYOUT = KVLayout(1, 1, 1, "float32", numpy=True)
STEP_MODES = ("sleep", "burn")


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: str  # a checkpoint directory: its config.json and fingerprint (no weights read)
    num_blocks: int = 4096
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_waiting: int = 256
    max_num_batched_tokens: int = 2048
    dtype: str = "float32"  # what the registered KV numerics say
    weight_dtype: str = "auto"
    kv_dtype: str = "auto"
    # A step's time: "sleep" (it costs the machine nothing: a thousand workers in one
    # process) or "burn" (spent on a core: workers sharing this machine's cores with real
    # services slow down as real ones do, engine/sim/cpu_burn.py).
    step: str = "sleep"

    def __post_init__(self) -> None:
        if self.step not in STEP_MODES:
            raise ValueError(f"step must be one of {STEP_MODES}, got {self.step!r}")
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@functools.cache
def _model_id(model: str) -> str:
    """The checkpoint's fingerprint, once per process (a thousand engines share it)."""
    return model_fingerprint(model).hex()


class SimLLM:
    """A simulated engine with AsyncLLM's interface (see that class for each method)."""

    cpu_isa = linear_kernels = attention_backend = "sim"

    def __init__(self, config: SimConfig, cost: SimCost) -> None:
        self.config = config
        self.model = config.model
        self.block_size = config.block_size
        self.max_num_waiting = config.max_num_waiting
        self.max_num_seqs = config.max_num_seqs
        self.kv_layout = SIM_KV_LAYOUT
        self.kv_block_bytes = 2 * 4 * config.block_size
        self.cost = cost
        self.costs = CostModel(config.max_num_batched_tokens)
        model = ModelConfig.from_dir(config.model)
        # As the real engine: no longer than the pool holds (a request that can never fit
        # would wait forever).
        self.max_model_len = min(
            model.max_position_embeddings, config.num_blocks * config.block_size
        )
        self.vocab_size = model.vocab_size
        numerics = kv_numerics(config.dtype, config.weight_dtype, config.kv_dtype)
        self.cache_salt = salt_of(_model_id(config.model), numerics)
        self.pool = BlockPool(config.num_blocks, record_events=True)
        self.scheduler = SimScheduler(
            self.pool,
            config.block_size,
            config.max_num_seqs,
            config.max_num_waiting,
            config.max_num_batched_tokens,
            model.vocab_size,
            frozenset(model.eos_token_ids),
        )
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._kv_watch: Callable[[], None] | None = None  # watch_kv_events
        self._stopped = False
        self._ids = 0

    # -- requests ------------------------------------------------------------------------
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
        """As AsyncLLM.generate; `tenant` is taken but not weighed (first come, first
        served within a priority class)."""
        if isinstance(prompt, str):
            raise ValueError("the simulated engine takes token ids, not text")
        if self._stopped:
            raise EngineStoppedError("engine shut down")
        prompt = list(prompt)
        check_prompt(prompt, self.vocab_size, self.max_model_len)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context ({self.max_model_len})"
            )
        self.salt_for(lora)
        if request_id is None:
            self._ids += 1
            request_id = f"req-{self._ids}"
        hashes = block_hashes or block_hash_keys(prompt, self.block_size, self.cache_salt)
        request = SimRequest(
            request_id,
            prompt,
            hashes,
            params,
            priority,
            export_kv_from=export_kv_from,
            export_kv=export_kv,
            remote_prefill=remote_prefill,
        )
        self.scheduler.add(request, held=prefetch is not None)  # ValueError, QueueFullError
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._start()
        fetch = asyncio.create_task(self._prefetch(request_id, prefetch)) if prefetch else None
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if fetch is not None:
                fetch.cancel()
            if not finished:
                self.abort(request_id)

    async def _prefetch(
        self, request_id: str, prefetch: Callable[[], Awaitable[StagedKV | None]]
    ) -> None:
        try:
            staged = await prefetch()
        except Exception:  # a lower tier is an optimisation: failing, it is a miss
            log.warning("prefix fetch for %s failed; computing it", request_id, exc_info=True)
            staged = None
        self.scheduler.release(request_id, staged)
        self._wake.set()

    def deliver_kv(self, request_id: str, kv: Sequence[PromptKV], first: SampledToken) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return  # aborted meanwhile
        try:
            self.scheduler.deliver_kv(request_id, list(kv), first.token_id)
        except (KeyError, ValueError) as exc:
            self.abort(request_id)
            stream.put_nowait(ValueError(f"cannot take the KV of {request_id}: {exc}"))
            return
        self._flush()
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self.scheduler.abort(request_id) is not None:
            self._wake.set()  # blocks were freed

    def salt_for(self, lora: str = "") -> bytes:
        if lora:
            raise UnknownAdapterError(f"LoRA adapter {lora!r} is not served (simulated worker)")
        return self.cache_salt

    async def add_lora(self, name: str, path: str):
        raise ValueError("the simulated worker serves no LoRA adapters")

    async def remove_lora(self, name: str):
        raise UnknownAdapterError(f"LoRA adapter {name!r} is not served (simulated worker)")

    # -- the cache and the numbers -------------------------------------------------------
    def warm(self, blocks: int, seed: int, prompt_blocks: int = 64) -> int:
        """Fill the prefix cache with `blocks` blocks (at most the pool) of synthetic
        prompts of `prompt_blocks` blocks, as if they had been computed and finished: keyed
        as real prompts are (chained from random tokens of `seed`), evictable, and published
        as KV events like any others. For benchmarks that need a master index of millions
        of blocks (bench/scale.py --warm-blocks). Returns the blocks cached."""
        rng = random.Random(seed)
        blocks = min(blocks, self.pool.num_free_blocks)
        cached = 0
        while cached < blocks:
            n = min(prompt_blocks, blocks - cached)
            # A random first block makes the chain distinct; the rest may repeat tokens.
            first = [rng.randrange(self.vocab_size) for _ in range(self.block_size)]
            tokens = first + [i % self.vocab_size for i in range((n - 1) * self.block_size)]
            held = self.pool.allocate(n)
            keys = block_hash_keys(tokens, self.block_size, self.cache_salt)
            for block, key in zip(held, keys, strict=True):
                self.pool.cache_block(block, key)
            self.pool.free(reversed(held))  # tail first, as a finished request's
            cached += n
        self._tell_kv_watch()
        return cached

    async def num_cached_prefix(self, block_hashes: list[BlockHash]) -> int:
        n = 0
        for key in block_hashes:
            if self.pool.get_cached(key) is None:
                break
            n += 1
        return n

    def kv_events_pending(self) -> bool:
        return self.pool.has_events()

    def watch_kv_events(self, callback: Callable[[], None]) -> None:
        self._kv_watch = callback
        self._tell_kv_watch()

    def _tell_kv_watch(self) -> None:
        if self._kv_watch is not None and self.pool.has_events():
            self._kv_watch()

    async def take_kv_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    async def kv_snapshot(self) -> tuple[list[KVEvent], tuple[list[BlockHash], list[BlockHash]]]:
        return self.pool.take_events(), (self.pool.cached_hashes(), [])

    async def check(self) -> EngineCheck:
        try:
            self.pool.check_integrity()
            error = ""
        except AssertionError as exc:
            error = str(exc) or "block pool integrity check failed"
        held = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        return EngineCheck(self.stats(), held, error)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_waiting=s.num_waiting,
            num_running=len(s.running),
            num_free_blocks=self.pool.num_free_blocks,
            num_total_blocks=self.pool.num_blocks,
            num_queued_tokens=s.num_queued_tokens,
        )

    def step_cost(self) -> StepCost:
        return self.costs.step()

    def shutdown(self) -> None:
        """Stop the step loop; unfinished requests end with EngineStoppedError. Callable
        from any thread (the workers call it off the loop)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._stopped = True
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._stop()
        else:
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                asyncio.run_coroutine_threadsafe(self._stop_async(), loop).result()

    async def _stop_async(self) -> None:
        self._stop()

    def _stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
        for request_id, stream in list(self._streams.items()):
            self.scheduler.abort(request_id)
            stream.put_nowait(EngineStoppedError("engine shut down"))
        self._streams.clear()

    # -- the step loop -------------------------------------------------------------------
    def _start(self) -> None:
        self._wake.set()
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug in a step must not strand callers
                log.exception("simulated step failed; aborting %d requests", len(self._streams))
                for request_id, stream in list(self._streams.items()):
                    self.scheduler.abort(request_id)
                    stream.put_nowait(exc)
                self._streams.clear()

    async def _step(self) -> None:
        """One step, or a wait for work."""
        work = self.scheduler.schedule()
        self._flush()
        if not work:
            self._wake.clear()
            await self._wake.wait()
            return
        seconds, prompt_tokens, rows = self._step_s(work)
        if self.config.step == "burn":  # the step as long as the cores make it
            began = time.perf_counter()
            await asyncio.to_thread(burn, seconds)
            seconds = time.perf_counter() - began
        else:
            await asyncio.sleep(seconds)
        self.scheduler.complete(work)
        self.costs.observe_step(seconds, prompt_tokens, rows)
        self._flush()

    def _step_s(self, work: list[Work]) -> tuple[float, int, int]:
        prompt_tokens = rows = decode_ctx = 0
        attended = 0.0
        for item in work:
            if item.prefill:
                prompt_tokens += item.num_tokens
                attended += item.num_tokens * (item.request.num_computed + item.num_tokens / 2)
            else:
                rows += 1
                decode_ctx += item.request.num_computed + item.num_tokens
        ctx = attended / prompt_tokens if prompt_tokens else 0.0
        return self.cost.step_s(prompt_tokens, ctx, rows, decode_ctx), prompt_tokens, rows

    def _flush(self) -> None:
        self._tell_kv_watch()
        outbox, self.scheduler.outbox = self.scheduler.outbox, []
        for out in outbox:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
                if out.finished:
                    del self._streams[out.request_id]
