"""How a worker resolves a prompt's prefix through the KV tiers before computing it.

Each prompt block is resolved through the tiers first (Algorithm 1 of the paper): found in
the device pool (or copied up from the engine's host tier), it is reused; else found in the
remote tier (the cache service instances, backed by Redis), it is fetched and imported into
the pool; else it is computed. The lookup (`Prefetch`) runs while the request is queued
(the engine holds it until the lookup is over, engine/scheduler.py). Full blocks computed here are written back to the remote tier
off the request path, unless requests are waiting for the engine (`writes_back`: a saturated
worker serves first). Prefill workers and fused workers both do this. The remote tier is an
optimisation: any failure reads as a miss, and a worker without one (`--no-remote-cache`)
uses its own pool alone. Blocks fetched from it are used only if their integrity tag matches
the key asked for (services/cache/integrity.py): a poisoned block reads as a miss too, and
is counted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from rtp_serve.core.block_hash import BlockHash
from rtp_serve.core.cost_model import TIER_REMOTE
from rtp_serve.engine.outputs import PromptKV, StagedKV
from rtp_serve.services.cache.client import CacheClient
from rtp_serve.services.cache.integrity import KVIntegrity
from rtp_serve.services.common.env import env
from rtp_serve.services.common.naming import MemberSet, NameClient
from rtp_serve.services.common.pb import common_pb2, nameservice_pb2
from rtp_serve.services.worker.kv_wire import join_blocks, split_blocks
from rtp_serve.services.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from rtp_serve.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)
MAX_PENDING_PUTS = 16


def add_tier_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-remote-cache",
        action="store_true",
        help="do not use the cache service tier (found through the nameservice)",
    )
    p.add_argument(
        "--kv-integrity-key",
        default=env("kv_integrity_key"),
        help="a secret every worker of the cluster shares: blocks in the cache tiers carry "
        "an HMAC-SHA256 with it (default: a plain SHA-256, which catches corruption only)",
    )


def cache_client(args: argparse.Namespace) -> CacheClient | None:
    """The remote tier's client (its instances come from the nameservice), unless disabled."""
    if args.no_remote_cache:
        return None
    secret = args.kv_integrity_key.encode() if args.kv_integrity_key else None
    return CacheClient([], integrity=KVIntegrity(secret))


@dataclasses.dataclass(frozen=True, slots=True)
class TierHits:
    device: int  # leading blocks found in the device pool
    remote: int  # further blocks fetched from the cache service

    @property
    def blocks(self) -> int:
        return self.device + self.remote


class Prefetch:
    """One prompt's lookup through the tiers (Algorithm 1): called by the engine while the
    request is queued, it returns the remote blocks to import; `hits` says what was found.
    The caller reports the request's admission (`admitted`), which counts what it reused."""

    def __init__(self, tiers: Tiers, prompt: list[int], hashes: list[BlockHash]) -> None:
        self.tiers = tiers
        # At least one prompt token is always computed: its logits give the next token.
        self.usable = hashes[: (len(prompt) - 1) // tiers.block_size]
        self.hits = TierHits(0, 0)  # until the lookup is done (or if it failed)
        self._counted = False

    async def __call__(self) -> StagedKV | None:
        tiers = self.tiers
        self.hits, staged = await tiers.lookup(self.usable)
        queried = len(self.usable) - self.hits.device if tiers.cache is not None else 0
        tiers.metrics.prefix_lookup(len(self.usable), queried, self.hits.remote)
        return staged

    def admitted(self, num_cached_tokens: int) -> None:
        """The request's first output: count, once, the blocks it reused from the device
        pool. Under load that is more than the lookup found: the prompts queued ahead of it
        may share its prefix, and were computed meanwhile."""
        if self._counted:
            return
        self._counted = True
        reused = num_cached_tokens // self.tiers.block_size
        self.tiers.metrics.prefix_reused(max(0, reused - self.hits.remote))


class Tiers:
    def __init__(self, llm: AsyncLLM, cache: CacheClient | None, metrics: WorkerMetrics) -> None:
        self.llm = llm
        self.cache = cache
        self.metrics = metrics
        self.block_size = llm.block_size
        self._puts: set[asyncio.Task] = set()

    async def follow(self, names: NameClient | None) -> None:
        """Follow the cache service instances in the nameservice."""
        if names is None or self.cache is None:
            return
        members = MemberSet()
        async for event in names.watch():
            members.apply(event)
            if event.member.role == nameservice_pb2.ROLE_CACHE:
                caches = members.with_role(nameservice_pb2.ROLE_CACHE)
                self.cache.set_addresses([m.address for m in caches])

    def prefetch(self, prompt: list[int], hashes: list[BlockHash]) -> Prefetch:
        """The lookup of this prompt's prefix through the tiers, to hand the engine as the
        request's `prefetch` (it runs while the request is queued)."""
        return Prefetch(self, prompt, hashes)

    async def lookup(self, usable: list[BlockHash]) -> tuple[TierHits, StagedKV | None]:
        """What the device pool (after the host tier's copy-up) and then the remote tier hold
        of these leading keys; the remote blocks come back to be imported."""
        device = await self.llm.num_cached_prefix(usable)
        if self.cache is None or device == len(usable):
            return TierHits(device, 0), None
        started = time.perf_counter()
        asked = usable[device:]
        found = await self.cache.get_prefix(asked)
        if found:  # hashing whole blocks: off the event loop (hashlib releases the GIL)
            found, rejected = await asyncio.to_thread(
                self.cache.integrity.valid_prefix, asked, found
            )
            if rejected:
                log.warning("dropped %d remote KV blocks failing their integrity check", rejected)
                self.metrics.kv_integrity_failures(rejected)
        if not found:
            return TierHits(device, 0), None
        bs = self.block_size
        end = device + len(found)
        try:
            kv = join_blocks(found, device * bs, end * bs, bs, usable, self.llm.kv_layout)
        except ValueError as exc:  # a bad remote block is a miss, not a failed request
            log.warning("ignoring remote KV blocks: %s", exc)
            return TierHits(device, 0), None
        # What the master's cost model predicts a remote hit with (rtp_serve/core/cost_model.py).
        self.llm.costs.observe_fetch(TIER_REMOTE, time.perf_counter() - started, kv.nbytes)
        return TierHits(device, len(found)), StagedKV(usable[device:end], kv)

    def writes_back(self) -> bool:
        """Whether the prompt of a request arriving now is to be written back to the remote
        tier: not while requests wait for this worker's engine. Writing back reads the KV
        out of the pool, serialises, hashes and sends it, on the cores the engine computes
        on: on 2 cores it cost a fused worker a fifth of its tokens/s at concurrency 16
        (docs/benchmarks.md). A saturated worker serves first; the fleet still gets the
        blocks of every worker with room to spare."""
        if self.cache is None:
            return False
        if self.llm.stats().num_waiting > 0:
            self.metrics.writeback_skipped()
            return False
        return True

    def write_back(self, blocks: list[common_pb2.KVBlock], hits: TierHits) -> None:
        """Put the full blocks computed here (past the hits) into the remote tier, in the
        background; dropped if too many puts are pending already."""
        computed = [b for b in blocks if b.block_hash and b.index >= hits.blocks]
        if self.cache is None or not computed or len(self._puts) >= MAX_PENDING_PUTS:
            return
        task = asyncio.create_task(self.cache.put(computed))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    def write_back_kv(self, kv: PromptKV, hashes: list[BlockHash], hits: TierHits) -> None:
        if self.cache is not None:
            self.write_back(split_blocks(kv, self.block_size, hashes), hits)

    @property
    def remote(self) -> bool:
        return self.cache is not None
