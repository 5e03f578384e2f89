"""How a worker resolves a prompt's prefix through the KV tiers before computing it, and which
of its blocks it writes back.

Each prompt block is resolved through the tiers first (Algorithm 1 of the paper): found in
the device pool (or copied up from the engine's host tier), it is reused; else found in the
remote tier (the cache service instances, backed by Redis), it is fetched and imported into
the pool; else it is computed. The lookup (`Prefetch`) runs while the request is queued
(the engine holds it until the lookup is over, engine/scheduler.py). The remote tier is
asked only for blocks the master's index says it may hold: a request routed by a
cache-aware policy carries `remote_blocks`, the longest prefix the remote tier can give by
that index, and a worker whose own tiers hold as much asks nothing (a lone fresh prompt's
lookup, a miss, was about 2 ms of its time to first token, on the cache service's cores as
well). The remote tier is an optimisation: any failure reads as a miss, and a worker without
one (`--no-remote-cache`) uses its own pool alone. Blocks fetched from it are used only if
their integrity tag matches the key asked for (services/cache/integrity.py): a poisoned
block reads as a miss too, and is counted.

Full blocks are written back to the remote tier off the request path, by prefill and fused
workers, unless requests wait for the engine (`writes_back`: a saturated worker serves
first). Which blocks is the write policy's (`--remote-write`):

    reused     blocks the device pool served to a second request, once (the default): what
               proves reusable reaches the fleet at its second use, and a prompt used once
               costs nothing (SGLang's selective write-through)
    computed   every block computed here, at its first use

Writing a prompt back reads its KV out of the pool, copies, seals, serialises and sends it,
and the cache service and Redis copy it again, all on the cores the engine computes on: on
2 cores, writing back every prompt made a fused worker's lone TTFT 1.3-1.4x the in-process
engine's (docs/cluster.md#the-kv-tiers).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from rtp_serve.core.block_hash import BlockHash
from rtp_serve.core.cost_model import TIER_REMOTE
from rtp_serve.engine.kv_export import KVExport
from rtp_serve.engine.outputs import PromptKV, StagedKV
from rtp_serve.services.cache.client import CacheClient
from rtp_serve.services.cache.integrity import KVIntegrity
from rtp_serve.services.common.env import env
from rtp_serve.services.common.naming import MemberSet, NameClient
from rtp_serve.services.common.pb import common_pb2, nameservice_pb2, worker_pb2
from rtp_serve.services.worker.kv_wire import join_blocks, split_blocks
from rtp_serve.services.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from rtp_serve.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)
MAX_PENDING_PUTS = 16
WRITE_POLICIES = ("reused", "computed")
# Keys this worker knows the remote tier holds (it wrote or fetched them), most recent kept:
# a reused block among them is not written again. About 100 bytes each: ~6 MiB.
MAX_KNOWN_KEYS = 1 << 16


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
    p.add_argument(
        "--remote-write",
        choices=WRITE_POLICIES,
        default=env("remote_write", "reused"),
        help="which blocks go to the remote tier: those the device pool served to a second "
        "request (reused), or every block computed here (computed)",
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


def remote_blocks(request: worker_pb2.GenerateRequest | worker_pb2.PrefillRequest) -> int | None:
    """The request's `remote_blocks` (None where unset: ask the remote tier as needed)."""
    return request.remote_blocks if request.HasField("remote_blocks") else None


class Prefetch:
    """One prompt's lookup through the tiers (Algorithm 1): called by the engine while the
    request is queued, it returns the remote blocks to import; `hits` says what was found.
    The caller reports the request's admission (`admitted`), which counts what it reused."""

    def __init__(
        self,
        tiers: Tiers,
        prompt: list[int],
        hashes: list[BlockHash],
        remote_blocks: int | None = None,
    ) -> None:
        self.tiers = tiers
        # At least one prompt token is always computed: its logits give the next token.
        self.usable = hashes[: (len(prompt) - 1) // tiers.block_size]
        self.remote_blocks = remote_blocks
        self.hits = TierHits(0, 0)  # until the lookup is done (or if it failed)
        self._counted = False

    async def __call__(self) -> StagedKV | None:
        tiers = self.tiers
        self.hits, staged, queried = await tiers.lookup(self.usable, self.remote_blocks)
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
    def __init__(
        self,
        llm: AsyncLLM,
        cache: CacheClient | None,
        metrics: WorkerMetrics,
        write_policy: str = "reused",
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy {write_policy!r} is not one of {WRITE_POLICIES}")
        self.llm = llm
        self.cache = cache
        self.metrics = metrics
        self.write_policy = write_policy
        self.block_size = llm.block_size
        self._puts: set[asyncio.Task] = set()
        self._known: OrderedDict[BlockHash, None] = OrderedDict()

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

    def prefetch(
        self, prompt: list[int], hashes: list[BlockHash], remote_blocks: int | None = None
    ) -> Prefetch:
        """The lookup of this prompt's prefix through the tiers, to hand the engine as the
        request's `prefetch` (it runs while the request is queued). `remote_blocks`: at most
        this many leading blocks are in the remote tier (None: unknown)."""
        return Prefetch(self, prompt, hashes, remote_blocks)

    async def lookup(
        self, usable: list[BlockHash], remote_blocks: int | None = None
    ) -> tuple[TierHits, StagedKV | None, int]:
        """What the device pool or the host tier (copied up at admission) and then the remote
        tier hold of these leading keys; the remote blocks come back to be imported, and the
        number of keys the remote tier was asked for. It is not asked where `remote_blocks`
        (what the master's index says it may hold) is no more than this worker holds."""
        device = self.llm.cached_prefix(usable)
        if self.cache is None or device == len(usable):
            return TierHits(device, 0), None, 0
        if remote_blocks is not None and remote_blocks <= device:
            self.metrics.remote_lookup_skipped()
            return TierHits(device, 0), None, 0
        started = time.perf_counter()
        asked = usable[device:]
        queried = len(asked)
        found = await self.cache.get_prefix(asked)
        if found:  # hashing whole blocks: off the event loop (hashlib releases the GIL)
            found, rejected = await asyncio.to_thread(
                self.cache.integrity.valid_prefix, asked, found
            )
            if rejected:
                log.warning("dropped %d remote KV blocks failing their integrity check", rejected)
                self.metrics.kv_integrity_failures(rejected)
        if not found:
            return TierHits(device, 0), None, queried
        bs = self.block_size
        end = device + len(found)
        try:
            kv = join_blocks(found, device * bs, end * bs, bs, usable, self.llm.kv_layout)
        except ValueError as exc:  # a bad remote block is a miss, not a failed request
            log.warning("ignoring remote KV blocks: %s", exc)
            return TierHits(device, 0), None, queried
        self._remember(usable[device:end])
        # What the master's cost model predicts a remote hit with (rtp_serve/core/cost_model.py).
        self.llm.costs.observe_fetch(TIER_REMOTE, time.perf_counter() - started, kv.nbytes)
        return TierHits(device, len(found)), StagedKV(usable[device:end], kv), queried

    def writes_back(self) -> bool:
        """Whether the prompt of a request arriving now may be written back to the remote
        tier: not while requests wait for this worker's engine. A saturated worker serves
        first (writing every computed prompt back cost a fused worker a fifth of its
        tokens/s at concurrency 16 on 2 cores, docs/cluster.md); the fleet still gets the
        blocks of every worker with room to spare."""
        if self.cache is None:
            return False
        if self.llm.stats().num_waiting > 0:
            self.metrics.writeback_skipped()
            return False
        return True

    def export(self, hashes: list[BlockHash]) -> tuple[int, KVExport] | None:
        """What a fused request arriving now asks its engine to export for the write-back
        (`export_kv_from` and the part, engine/kv_export.py), or None for nothing: the blocks
        computed here, or those its prefix cache serves from the first one the remote tier
        is not known to hold."""
        if not self.writes_back():
            return None
        if self.write_policy == "computed":
            return 0, KVExport.COMPUTED
        first = next((i for i, key in enumerate(hashes) if key not in self._known), None)
        return None if first is None else (first * self.block_size, KVExport.REUSED)

    def write_back(
        self, blocks: list[common_pb2.KVBlock], hits: TierHits, reused_blocks: int
    ) -> None:
        """Put the full blocks the write policy picks into the remote tier, in the
        background: those computed here (past the hits), or those the device pool served
        (below `reused_blocks`) that the remote tier is not known to hold. Dropped if too
        many puts are pending already."""
        if self.write_policy == "computed":
            chosen = [b for b in blocks if b.block_hash and b.index >= hits.blocks]
        else:
            chosen = [
                b
                for b in blocks
                if b.block_hash and b.index < reused_blocks and b.block_hash not in self._known
            ]
        if self.cache is None or not chosen or len(self._puts) >= MAX_PENDING_PUTS:
            return
        task = asyncio.create_task(self._put(chosen))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    def write_back_kv(
        self, kv: PromptKV, hashes: list[BlockHash], hits: TierHits, reused_blocks: int
    ) -> None:
        if self.cache is not None:
            self.write_back(split_blocks(kv, self.block_size, hashes), hits, reused_blocks)

    async def _put(self, blocks: list[common_pb2.KVBlock]) -> None:
        assert self.cache is not None
        if await self.cache.put(blocks) == len(blocks):  # else written at a later reuse
            self._remember([b.block_hash for b in blocks])

    def _remember(self, keys: list[BlockHash]) -> None:
        """The remote tier holds these keys, as far as this worker knows."""
        known = self._known
        for key in keys:
            known[key] = None
            known.move_to_end(key)
        while len(known) > MAX_KNOWN_KEYS:
            known.popitem(last=False)

    @property
    def remote(self) -> bool:
        return self.cache is not None

    @property
    def pending_puts(self) -> int:
        """Write-backs under way in the background."""
        return len(self._puts)
