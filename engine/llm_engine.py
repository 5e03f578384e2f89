"""The synchronous engine: add requests, step (schedule, run, update), read output deltas."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from rtp_serve.core.block_hash import BlockHash, model_fingerprint
from rtp_serve.core.cost_model import CostModel
from rtp_serve.core.dtypes import kv_numerics
from rtp_serve.core.model_config import ModelConfig
from rtp_serve.core.outputs import SampledToken
from rtp_serve.core.peft_config import LoraConfig
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.structured import Grammars
from rtp_serve.core.tenant import DEFAULT_SHARE, TenantShare
from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.core.validation import (
    InvalidRequestError,
    check_logit_bias,
    check_prompt,
    check_speculative_advice,
    check_stop_token_ids,
)
from rtp_serve.engine.config import EngineConfig, KVLayout
from rtp_serve.engine.kv_cache_manager import KVCacheManager
from rtp_serve.engine.kv_export import KVExport, export_range
from rtp_serve.engine.kv_tiers import KVTiers
from rtp_serve.engine.lora.admin import LoraAdmin
from rtp_serve.engine.model_runner import ModelRunner, resolve_limits
from rtp_serve.engine.outputs import PromptKV, RequestOutput, StagedKV
from rtp_serve.engine.request import Request, RequestStatus
from rtp_serve.engine.scheduler import Scheduler, SchedulerConfig
from rtp_serve.engine.spec_decode.draft_model import DraftModelProposer, TargetKV
from rtp_serve.engine.spec_decode.ngram import NgramProposer
from rtp_serve.engine.spec_decode.proposer import Proposer
from rtp_serve.engine.spec_decode.speculator import Speculator
from rtp_serve.engine.stats import EngineCheck, EngineStats

log = logging.getLogger(__name__)

# The ITL target's smallest chunk where no efficiency curve was measured (a GPU, the fixed
# GEMM split): on the CPUs measured, from 128 rows a step's projections ran within 10% of
# their best per row (bench/gemm.py).
DEFAULT_EFFICIENT_ROWS = 128


class LLMEngine:
    def __init__(self, config: EngineConfig, record_kv_events: bool = False) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config = ModelConfig.from_dir(config.model)
        self.limits = resolve_limits(self.model_config, config)
        self.tokenizer = Tokenizer(config.model)
        self.runner = ModelRunner(self.model_config, config, self.limits)
        # Fitted step and fetch times: the wait estimate here, the master's predictions.
        self.costs = CostModel(config.max_num_batched_tokens)
        if config.itl_target_ms:
            log.info(
                "ITL target %g ms: while requests decode, a step's prompt chunk fits it, "
                "down to %d rows",
                config.itl_target_ms,
                self.runner.efficient_rows or DEFAULT_EFFICIENT_ROWS,
            )
        # The device pool and the tiers around it: host tier, imported and remote KV.
        self.tiers = KVTiers(
            self.limits.num_kv_blocks,
            config.block_size,
            config.host_kv_cache_bytes,
            self.runner,
            self.costs,
            record_kv_events,
        )
        self.pool = self.tiers.pool
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.limits.max_model_len,
                config.max_num_waiting,
                config.max_loras,
                config.fair_scheduling,
            ),
            self.kv,
            self.model_config.eos_token_ids,
            prepare=self.tiers.prepare_admission,
        )
        # Adapters added and removed while requests run, each salting its own KV namespace.
        self.loras = self.runner.loras
        self.adapters = LoraAdmin(
            self.loras,
            self.scheduler.requests,
            model_fingerprint(config.model).hex(),
            kv_numerics(config.dtype, config.weight_dtype, config.kv_dtype),
        )
        self.cache_salt = self.adapters.base_salt  # core.block_hash.cache_salt
        for name, path in config.loras:
            self.adapters.add(LoraConfig.load(name, path))
        cfg = self.model_config
        self.kv_layout = KVLayout(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.resolved_kv_dtype
        )
        # Structured outputs: specs compiled for this model's tokenizer, cached by spec.
        self.grammars = Grammars(
            Path(config.model) / "tokenizer.json", cfg.vocab_size, cfg.eos_token_ids
        )
        self.speculator = self._speculator(config)
        self._seeds = random.Random(config.seed)  # for requests that bring no seed

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        if config.speculative is None:
            return None
        if config.speculative == "ngram":
            proposer: Proposer = NgramProposer()
        else:
            proposer = DraftModelProposer(
                self.model_config,
                self.runner.weight_bytes_per_step,
                config,
                self.limits,
                config.draft_model,
                config.draft_num_layers,
                TargetKV(self.runner.kv_cache, self.kv.block_ids),
            )
        return Speculator(proposer, config.num_speculative_tokens, self.limits.max_model_len)

    # -- requests --------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        export_kv_from: int | None = None,
        export_kv: KVExport = KVExport.PROMPT,
        remote_prefill: bool = False,
        block_hashes: list[BlockHash] | None = None,
        lora: str = "",
        tenant: TenantShare = DEFAULT_SHARE,
    ) -> Request:
        """Validate and convert a prompt into an engine request (raises ValueError, or
        UnknownAdapterError for a `lora` adapter this engine does not serve).

        `export_kv_from`: the last output carries the prompt's KV from this position on, the
        part `export_kv` says (engine/kv_export.py). `remote_prefill`: PD decode side, the
        prompt's KV comes from elsewhere (see `write_remote_kv`). `block_hashes`: the
        prompt's keys, if this process has them.
        """
        salt = self.adapters.salt_for(lora)  # raises UnknownAdapterError first
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model_config.vocab_size
        check_prompt(token_ids, vocab, self.limits.max_model_len)
        check_stop_token_ids(params.stop_token_ids, vocab)
        check_logit_bias(params.logit_bias, vocab)
        check_speculative_advice(params.speculative_advice, vocab, self.limits.max_model_len)
        guide = None
        if params.structured is not None:
            resumed = params.structured.resume_tokens
            if not 0 <= resumed < len(token_ids):
                raise InvalidRequestError(
                    f"resume_tokens {resumed} not below the prompt length", "structured_outputs"
                )
            made = token_ids[len(token_ids) - resumed :] if resumed else []
            guide = self.grammars.guide(params.structured, made)
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            block_size=self.config.block_size,
            salt=salt,
            lora=lora,
            priority=priority,
            tenant=tenant,
            block_hashes=block_hashes or [],
            export_kv_from=export_kv_from,
            export_kv=export_kv,
            remote_prefill=remote_prefill,
            guide=guide,
            sample_seed=self._seeds.getrandbits(63),  # ignored when params.seed is set
        )

    def add_request(self, request: Request, held: bool = False) -> None:
        """Queue a request; `held`: its prefix is being fetched from a lower tier, and it
        is not admitted before `release_request`."""
        if request.lora:
            self.loras.count_request(request.lora)
        self.tiers.copy_up_prefix(request)
        self.scheduler.add_request(request, held)

    def release_request(self, request_id: str, staged: StagedKV | None) -> int:
        """A held request's tier fetch is over: import what it found (None: nothing) and let
        the request be admitted. Returns how many blocks were imported (0 also for a request
        that is gone or not held)."""
        request = self.scheduler.release(request_id)
        if request is None or staged is None:
            return 0
        request.staged_kv = staged
        return self.tiers.import_blocks(staged.block_hashes, staged.kv)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is not None and self.speculator is not None:
            self.speculator.release(request_id)
        return None if request is None else _delta(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_schedulable_requests(self) -> bool:
        """False when nothing can run until something arrives (a command, remote KV)."""
        return self.scheduler.has_schedulable()

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.costs.step())
        sched = self.scheduler.schedule(self.prompt_cap())
        outputs = [_delta(r, waiting_for_kv=True) for r in sched.waiting_for_kv]
        if not sched.scheduled:
            return outputs
        tables = {
            s.request.request_id: self.kv.block_ids(s.request.request_id) for s in sched.scheduled
        }
        decodes = [
            s
            for s in sched.scheduled
            if s.request.num_computed_tokens >= s.request.num_prompt_tokens
        ]
        decode = sum(s.num_new_tokens for s in decodes)  # verified drafts count as decode
        prompt = sum(s.num_new_tokens for s in sched.scheduled) - decode
        sampled = self.runner.execute(sched, tables)
        if self.speculator is not None:
            for s in decodes:
                if s.spec_token_ids:
                    accepted = len(sampled[s.request.request_id]) - 1
                    self.speculator.observe(s.request, len(s.spec_token_ids), accepted)
        advanced, finished = self.scheduler.update_from_output(sched, sampled)
        if self.speculator is not None:
            for r in finished:
                self.speculator.release(r.request_id)
        exports = {
            r.request_id: self._export(r, tables[r.request_id])
            for r in finished
            if r.export_kv_from is not None
        }
        outputs += [_delta(r, tokens, exports.get(r.request_id)) for r, tokens in advanced]
        self.costs.observe_step(time.perf_counter() - started, prompt, decode)
        return outputs

    def prompt_cap(self, decode_rows: int | None = None) -> int | None:
        """Prompt tokens the next step may compute under the ITL target (None: no cap).

        Only while requests decode: their next token waits for the whole step, so the step
        takes as many prompt tokens as its predicted time (fixed + token_s * tokens + row_s
        * rows, fitted from this engine's steps) leaves room for under the target, but no
        fewer than fill the rows from which its GEMMs run near their best per row (the
        efficiency curve measured at load, gemm_table.efficient_rows) less the decode rows
        that ride along: a smaller chunk would cost more per token than the ITL it saves.
        With nobody decoding, or nothing fitted yet, the token budget alone applies.
        `decode_rows`: the rows decoding (default: the scheduler's, on the engine thread;
        another thread passes its own count, and reads nothing else that a step changes)."""
        target_s = self.config.itl_target_ms / 1e3
        if not target_s:
            return None
        rows = self.scheduler.num_decoding() if decode_rows is None else decode_rows
        cost = self.costs.step()
        if not rows or cost.token_s <= 0:
            return None
        fits = int((target_s - cost.fixed_s - cost.row_s * rows) / cost.token_s)
        efficient = self.runner.efficient_rows or DEFAULT_EFFICIENT_ROWS
        return max(fits, efficient - rows, 1)

    def _export(self, request: Request, block_ids: list[int]) -> PromptKV | None:
        # The blocks were released by this very step, but nothing can reuse them before the
        # next schedule(), so their contents are still this request's KV.
        start, end = export_range(
            request.export_kv,
            request.export_kv_from or 0,
            max(0, request.num_cached_tokens),
            request.num_prompt_tokens,
        )
        return self.runner.read_kv(block_ids, start, end) if start < end else None

    # -- PD decode side --------------------------------------------------------------------
    def write_remote_kv(
        self, request_id: str, parts: Sequence[PromptKV], first: SampledToken
    ) -> RequestOutput:
        """A remote-prefill request's prompt KV and first token arrived: write the KV into its
        blocks and decode on. `parts` must cover every prompt position not cached here
        (ValueError otherwise, or for a request not waiting for it)."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV")
        table = self.kv.block_ids(request_id)
        self.tiers.write_remote_kv(request, table, parts, first, self.model_config.vocab_size)
        # No random state to carry over: draws are keyed by position (sampling_noise.py).
        return _delta(self.scheduler.kv_arrived(request_id, first), [first])

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        queued = sum(
            len(r.token_ids) - r.num_computed_tokens
            for r in s.requests.values()
            if r.status != RequestStatus.WAITING_FOR_REMOTE_KV  # computed elsewhere
        )
        return EngineStats(
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            num_free_blocks=self.pool.num_free_blocks,
            num_total_blocks=self.pool.num_blocks,
            num_queued_tokens=queued,
            host_tier=self.tiers.host_stats(),
            spec=None if self.speculator is None else self.speculator.stats(),
            loras=self.loras.stats(),
        )

    def check(self) -> EngineCheck:
        error = ""
        try:
            self.check_integrity()
        except AssertionError as exc:
            error = str(exc) or "integrity check failed"
        held = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        return EngineCheck(self.stats(), held, error)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.tiers.check_integrity()
        if self.speculator is not None:
            self.speculator.check_integrity()


def _delta(
    request: Request,
    tokens: Sequence[SampledToken] = (),
    prompt_kv: PromptKV | None = None,
    waiting_for_kv: bool = False,
) -> RequestOutput:
    """The output of `request` after a step that added `tokens` (several with drafts)."""
    finished = request.status.finished
    logprobs = None
    if request.params.logprobs is not None:
        logprobs = [t.logprobs for t in tokens if t.logprobs is not None]
    queue_s = prefill_s = None
    if tokens and request.num_output_tokens == len(tokens) and request.scheduled_time:
        queue_s = request.scheduled_time - request.arrival_time
        prefill_s = time.monotonic() - request.scheduled_time
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[t.token_id for t in tokens],
        new_logprobs=logprobs,
        finished=finished,
        finish_reason=request.status.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        stop_reason=request.stop_reason,
        prompt_kv=prompt_kv,
        waiting_for_kv=waiting_for_kv,
        queue_s=queue_s,
        prefill_s=prefill_s,
    )
