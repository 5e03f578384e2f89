"""Drafts from a smaller model in the same worker, over its own paged KV.

The draft is any model with the target's tokenizer (`--draft-model DIR`), or the target cut
to its first m layers plus its final norm and head (`--draft-layers M`, the built-in option:
self-speculation, no second checkpoint). It drafts greedily, so each draft is a function of
the context, which is all the acceptance rule (engine/spec_decode/rejection.py) needs: the output
is the target's, token for token, whatever the draft proposes.

Each request that speculates has a shadow here: an engine Request over the draft's own block
pool whose tokens track the target request's. Per engine step, for the requests that may
draft:

1. sync: the shadow keeps the KV of its longest token prefix the target request still has
   (a rejected draft's KV is cut off, as the target's is) and takes the target's tokens;
2. draft pass 1: every shadow computes what it has not seen (its prompt on first use, the
   tokens accepted since, at least the last one) in one batched forward pass of the draft
   model, sampling draft 1;
3. passes 2..k: one token each, batched, until every request has its budget.

Shadows live until the engine releases their request (finished, aborted); when the draft's
pool is full, the least recently drafted shadow not in this step is dropped (it computes
its context again when it next drafts), and a request that still does not fit drafts
nothing this step.

A draft made of the target's own first layers (`target_kv`) computes nothing the target
has: the KV of those layers for the tokens the target has computed is the draft's KV, so
step 2 copies it from the target's cache into the shadow's blocks, and the draft pass
computes only the last token. A probe after a long pause, or a request's first, then costs
one short pass, not a pass over its whole context. (Not for an INT8 cache, whose scales are
per block, nor under a LoRA adapter, which the draft runs without.)
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rtp_serve.core.model_config import ModelConfig
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.engine.block_pool import BlockPool
from rtp_serve.engine.config import EngineConfig, EngineLimits
from rtp_serve.engine.kv_cache_manager import KVCacheManager
from rtp_serve.engine.memory import kv_bytes_per_block
from rtp_serve.engine.model_runner import ModelRunner
from rtp_serve.engine.request import Request, RequestStatus
from rtp_serve.engine.scheduler import ScheduledRequest, SchedulerOutput
from rtp_serve.engine.spec_decode.proposer import PassTimer

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class TargetKV:
    """The target's paged KV, for a draft made of its first layers."""

    cache: torch.Tensor  # [layers, 2, slots, kv heads, head dim]
    block_ids: Callable[[str], list[int]]  # a request's blocks, in order


class DraftModelProposer:
    def __init__(
        self,
        target: ModelConfig,
        target_step_bytes: int,
        config: EngineConfig,
        limits: EngineLimits,
        draft_model: str | None = None,
        num_layers: int | None = None,
        target_kv: TargetKV | None = None,
    ) -> None:
        """`target_step_bytes`: the weight bytes a decode step of the target streams;
        `draft_model` None: the target's own checkpoint; `num_layers`: only its first layers
        (None: all of the draft model's; with no draft model, a quarter of the target's);
        `target_kv`: the target's cache, used where the draft is the target's first layers."""
        model_dir = draft_model or config.model
        cfg = ModelConfig.from_dir(model_dir)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({cfg.vocab_size}) is not the target's "
                f"({target.vocab_size}): it needs the same tokenizer"
            )
        if num_layers is None and draft_model is None:
            num_layers = max(1, cfg.num_layers // 4)
        all_layers = cfg.num_layers
        if num_layers is not None:
            if not 1 <= num_layers <= all_layers:
                raise ValueError(f"draft layers must be in [1, {all_layers}], got {num_layers}")
            cfg = replace(cfg, num_layers=num_layers)
        self.model_config = cfg
        # As many tokens as the target's pool: every running request can have its shadow.
        bytes_per_block = kv_bytes_per_block(cfg, config.resolved_kv_dtype, config.block_size)
        draft_limits = replace(limits, bytes_per_block=bytes_per_block)
        truncated = cfg.num_layers < all_layers
        self.runner = ModelRunner(cfg, replace(config, model=model_dir), draft_limits, truncated)
        self.block_size = config.block_size
        self.kv = KVCacheManager(
            BlockPool(limits.num_kv_blocks), config.block_size, enable_caching=False
        )
        # What a pass costs beside the target's decode step: timed, guessed from the weights
        # each streams until then.
        self.timer = PassTimer(self.runner.weight_bytes_per_step / target_step_bytes)
        self._shadows: OrderedDict[str, Request] = OrderedDict()  # least recently drafted first
        self._synced: dict[str, int] = {}  # the request's length when its shadow last synced
        same_model = (
            draft_model is None or Path(draft_model).resolve() == Path(config.model).resolve()
        )
        self._target_kv = (
            target_kv if same_model and self.runner.kv_scales is None else None
        )  # the draft's layers are the target's first ones, in a cache without scales
        log.info("draft model: %s, %d of %d layers", model_dir, cfg.num_layers, all_layers)

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = {r.request_id for r, k in zip(requests, budgets, strict=True) if k > 0}
        todo: list[tuple[int, Request, int]] = []  # (index, shadow, budget)
        for i, (r, k) in enumerate(zip(requests, budgets, strict=True)):
            if k > 0:
                shadow = self._sync(r)
                if self._room(shadow, len(shadow.token_ids) - shadow.num_computed_tokens, live):
                    self._copy_target_kv(r, shadow)
                    todo.append((i, shadow, k))
        while todo:
            sched = SchedulerOutput(
                [ScheduledRequest(s, len(s.token_ids) - s.num_computed_tokens) for _, s, _ in todo]
            )
            tables = {s.request_id: self.kv.block_ids(s.request_id) for _, s, _ in todo}
            short = all(n.num_new_tokens <= PassTimer.SHORT for n in sched.scheduled)
            start = time.perf_counter()
            sampled = self.runner.execute(sched, tables)
            if short:
                self.timer.observe(time.perf_counter() - start)
            more = []
            for i, s, k in todo:
                s.num_computed_tokens = len(s.token_ids)
                token = sampled[s.request_id][0].token_id
                drafts[i].append(token)
                s.token_ids.append(token)
                if len(drafts[i]) < k and self._room(s, 1, live):
                    more.append((i, s, k))
            todo = more
        return drafts

    def release(self, request_id: str) -> None:
        """The target request ended: its shadow and its blocks go."""
        shadow = self._shadows.pop(request_id, None)
        self._synced.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    # -- shadows ---------------------------------------------------------------------------
    def _sync(self, request: Request) -> Request:
        """The request's shadow, holding the KV of the longest prefix of its tokens the
        request still has, and the request's tokens."""
        rid = request.request_id
        shadow = self._shadows.pop(rid, None)
        if shadow is None:
            shadow = Request(rid, [], _GREEDY, self.block_size, status=RequestStatus.RUNNING)
            self._synced[rid] = 0
        self._shadows[rid] = shadow  # now the most recently drafted
        # Up to the last sync the shadow's tokens are the request's (which only grow); past
        # it are the drafts, kept as far as the request accepted them.
        same = min(self._synced[rid], shadow.num_computed_tokens)
        limit = min(shadow.num_computed_tokens, len(request.token_ids) - 1)
        while same < limit and shadow.token_ids[same] == request.token_ids[same]:
            same += 1
        if same < shadow.num_computed_tokens:
            self.kv.truncate(shadow, same)
        shadow.num_computed_tokens = same
        shadow.token_ids = list(request.token_ids)
        self._synced[rid] = len(request.token_ids)
        return shadow

    def _copy_target_kv(self, request: Request, shadow: Request) -> None:
        """The target's KV of the tokens it has computed and the shadow has not, copied
        into the shadow's blocks (allocated already), for the draft's layers."""
        start, end = shadow.num_computed_tokens, request.num_computed_tokens
        if self._target_kv is None or request.lora or end <= start:
            return
        device = self.runner.kv_cache.device
        pos = torch.arange(start, end, device=device)
        bs = self.block_size
        src = torch.tensor(self._target_kv.block_ids(request.request_id), device=device)
        dst = torch.tensor(self.kv.block_ids(shadow.request_id), device=device)
        layers = self.model_config.num_layers
        self.runner.kv_cache.index_copy_(
            2,
            dst[pos // bs] * bs + pos % bs,
            self._target_kv.cache[:layers].index_select(2, src[pos // bs] * bs + pos % bs),
        )
        shadow.num_computed_tokens = end

    def _room(self, shadow: Request, num_new: int, live: set[str]) -> bool:
        """Blocks for `num_new` more tokens of `shadow`, dropping the least recently drafted
        shadows outside this step while they are short; False if they stay short."""
        while not self.kv.allocate_slots(shadow, num_new, cache=False):
            victim = next((rid for rid in self._shadows if rid not in live), None)
            if victim is None:
                return False
            self.release(victim)
        return True
