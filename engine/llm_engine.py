"""The synchronous engine: add requests, step (schedule, run, update), read outputs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner, resolve_limits
from engine.outputs import PromptKV, RequestOutput
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import SampledToken, Scheduler, SchedulerConfig
from engine.tokenizer import Tokenizer
from services.common.block_hash import hash_extra

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for load reports and metrics."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_queued_tokens: int  # prompt/recompute tokens not yet computed


class LLMEngine:
    def __init__(self, config: EngineConfig, record_kv_events: bool = False) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config = ModelConfig.from_dir(config.model)
        self.limits = resolve_limits(self.model_config, config)
        self.tokenizer = Tokenizer(config.model)
        self.runner = ModelRunner(self.model_config, config, self.limits)
        self.pool = BlockPool(self.limits.num_kv_blocks, record_events=record_kv_events)
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, config.max_num_batched_tokens, self.limits.max_model_len
            ),
            self.kv,
            self.model_config.eos_token_ids,
        )
        self.hash_extra = hash_extra(
            self.model_config.architecture + ":" + config.model, config.dtype
        )

    # -- requests --------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        export_kv_from: int | None = None,
    ) -> Request:
        """Validate and convert a prompt into an engine request (raises ValueError)."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        limit = self.limits.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, but the context length is {limit} "
                f"(the prompt must be shorter to leave room for output)"
            )
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids out of range [0, {vocab}): {bad_stop}")
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            block_size=self.config.block_size,
            hash_extra=self.hash_extra,
            priority=priority,
            export_kv_from=export_kv_from,
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return None if request is None else RequestOutput.from_request(request, 0)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        tables = {
            s.request.request_id: self.kv.block_ids(s.request.request_id) for s in sched.scheduled
        }
        sampled = self.runner.execute(sched, tables)
        advanced, finished = self.scheduler.update_from_output(sched, sampled)
        exports = {
            r.request_id: self._export(r, tables[r.request_id])
            for r in finished
            if r.export_kv_from is not None
        }
        return [RequestOutput.from_request(r, 1, exports.get(r.request_id)) for r in advanced]

    def _export(self, request: Request, block_ids: list[int]) -> PromptKV:
        # The blocks were released by this very step, but nothing can reuse them before the
        # next schedule(), so their contents are still this request's KV.
        start = request.export_kv_from or 0
        k, v = self.runner.read_kv(block_ids, start, request.num_prompt_tokens)
        return PromptKV(start, k, v)

    # -- tiers below the device pool ---------------------------------------------------------
    def num_cached_prefix(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of these keys the device pool holds right now."""
        n = 0
        for h in block_hashes:
            if self.pool.get_cached(h) is None:
                break
            n += 1
        return n

    def import_blocks(self, block_hashes: list[bytes], k, v) -> int:
        """Put KV fetched from a lower tier into the pool as cached, unreferenced blocks.

        k/v are [layers, len(block_hashes) * block_size, kv_heads, D]. A request submitted
        next hits them like any prefix-cache block (they join the back of the eviction
        queue). Blocks already cached are skipped; returns how many were imported.
        """
        bs = self.config.block_size
        imported = 0
        for i, h in enumerate(block_hashes):
            if self.pool.get_cached(h) is not None:
                continue
            if self.pool.num_free_blocks == 0:
                break
            (block,) = self.pool.allocate(1)
            self.runner.write_kv(
                [block.block_id], 0, k[:, i * bs : (i + 1) * bs], v[:, i * bs : (i + 1) * bs]
            )
            self.pool.cache_block(block, h)
            self.pool.free([block])
            imported += 1
        return imported

    # -- PD decode side --------------------------------------------------------------------
    def reserve(self, request: Request) -> int:
        """Hold blocks for a prompt computed elsewhere; returns prompt tokens cached here."""
        return self.scheduler.reserve(request)

    def write_prompt_kv(self, request_id: str, start: int, k, v) -> None:
        request = self.scheduler.reserved[request_id]
        if start + k.shape[1] > request.num_prompt_tokens:
            raise ValueError(f"KV for tokens [{start}, {start + k.shape[1]}) is past the prompt")
        self.runner.write_kv(self.kv.block_ids(request_id), start, k, v)

    def activate(self, request_id: str, first: SampledToken) -> RequestOutput:
        """Every prompt block is written: decode on from the prefill side's first token."""
        if not 0 <= first.token_id < self.model_config.vocab_size:
            raise ValueError(f"first token id {first.token_id} out of range")
        Sampler.replay_draw(self.scheduler.reserved[request_id], self.model_config.vocab_size)
        return RequestOutput.from_request(self.scheduler.activate(request_id, first), 1)

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        queued = sum(len(r.token_ids) - r.num_computed_tokens for r in s.requests.values())
        return EngineStats(
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            num_free_blocks=self.pool.num_free_blocks,
            num_total_blocks=self.pool.num_blocks,
            num_queued_tokens=queued,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
