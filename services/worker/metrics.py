"""A worker's metric families: load gauges, prefix-cache lookups by tier, KV transfer,
speculative decoding, LoRA adapters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rtp_serve.engine.lora.stats import LoraStats
from rtp_serve.engine.spec_decode.stats import SpecCounts
from rtp_serve.services.common.metrics import (
    TIER_DEVICE,
    TIER_HOST,
    TIER_REMOTE,
    Families,
    MetricSpec,
    default_families,
    role_label,
)

if TYPE_CHECKING:
    from rtp_serve.engine.host_tier import HostTierStats

_W = ("role", "model_name")  # every family is per worker role and served model


class WorkerFamilies(Families):
    SPECS = (
        MetricSpec(
            "num_requests_running", "gauge", "num_requests_running",
            "Requests in the worker's running batch.",
            _W,
        ),
        MetricSpec(
            "num_requests_waiting", "gauge", "num_requests_waiting",
            "Requests waiting to be scheduled on the worker.",
            _W,
        ),
        MetricSpec(
            "kv_cache_usage_perc", "gauge", "kv_cache_usage_perc",
            "Fraction of the worker's KV blocks in use (1 = full; cached free blocks count "
            "as free).",
            _W,
        ),
        MetricSpec(
            "kv_cache_capacity_tokens", "gauge", "kv_cache_capacity_tokens",
            "Tokens the worker's KV pool holds (blocks x block size), as sized at start.",
            _W,
        ),
        MetricSpec(
            "queue_wait_estimate_seconds", "gauge", "queue_wait_estimate_seconds",
            "Estimated wait before a request arriving now gets its first step: queued prompt "
            "tokens / measured prefill rate, plus a decode step if a batch runs (0: unmeasured).",
            _W,
        ),
        MetricSpec(
            "prefill_throughput", "gauge", "prefill_throughput_tokens_per_second",
            "Prompt tokens computed per second in full chunks, from the fitted step model (0: unfitted).",
            _W,
        ),
        MetricSpec(
            "prefix_cache_queries", "counter", "prefix_cache_queries",
            "Prompt blocks looked up in a prefix-cache tier (device: the worker's pool; "
            "remote: the cache service, for the blocks the device lacked).",
            (*_W, "tier"),
        ),
        MetricSpec(
            "prefix_cache_hits", "counter", "prefix_cache_hits",
            "Prompt blocks served by a prefix-cache tier. device: the blocks a request reused "
            "from the worker's pool when admitted (after its queue: prompts computed ahead of "
            "it count; blocks its remote fetch brought do not, those copied up from the host "
            "tier do); host: the blocks copied up from it; remote: the blocks fetched from "
            "the cache service.",
            (*_W, "tier"),
        ),
        MetricSpec(
            "host_tier_bytes", "gauge", "host_kv_tier_bytes",
            "Bytes of KV held in the worker's host-memory tier (T1), and its capacity.",
            (*_W, "kind"),
        ),
        MetricSpec(
            "kv_transfer_bytes", "counter", "kv_transfer_bytes",
            "KV bytes moved between prefill and decode workers (the blocks' K, V and scales).",
            (*_W, "direction"),
        ),
        MetricSpec(
            "kv_writeback_skipped", "counter", "kv_writeback_skipped",
            "Prompts whose computed blocks were not written back to the remote tier because "
            "requests were waiting for this worker's engine (write-back yields to serving).",
            _W,
        ),
        MetricSpec(
            "remote_lookups_skipped", "counter", "remote_lookups_skipped",
            "Prompts whose lookup did not ask the remote tier: the master's index said it "
            "holds no more of the prompt than this worker does (RoutePlan.remote_blocks).",
            _W,
        ),
        MetricSpec(
            "kv_transfer_blocks", "counter", "kv_transfer_blocks",
            "KV blocks moved between prefill and decode workers.",
            (*_W, "direction"),
        ),
        MetricSpec(
            "kv_transfers_in_flight", "gauge", "kv_transfers_in_flight",
            "Prompt KV transfers between prefill and decode workers under way: blocks being "
            "sent (prefill) or received (decode) for a request.",
            (*_W, "direction"),
        ),
        MetricSpec(
            "kv_integrity_failures", "counter", "kv_integrity_failures",
            "KV blocks from the cache tiers dropped (and recomputed) because their integrity "
            "tag did not match their key: corrupted, stored under another key, or forged.",
            _W,
        ),
        # Speculative decoding, named as vLLM's spec_decode_* families.
        MetricSpec(
            "spec_num_drafts", "counter", "spec_decode_num_drafts",
            "Drafts verified (one request's proposal in one step).",
            _W,
        ),
        MetricSpec(
            "spec_num_draft_tokens", "counter", "spec_decode_num_draft_tokens",
            "Draft tokens proposed and verified.",
            _W,
        ),
        MetricSpec(
            "spec_num_accepted_tokens", "counter", "spec_decode_num_accepted_tokens",
            "Draft tokens the target model accepted.",
            _W,
        ),
        MetricSpec(
            "spec_accepted_per_pos", "counter", "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first draft token).",
            (*_W, "position"),
        ),
        MetricSpec(
            "spec_acceptance_rate_per_pos", "gauge", "spec_decode_acceptance_rate_per_pos",
            "Of the drafts that reached a position, the fraction accepted there (since start).",
            (*_W, "position"),
        ),
        MetricSpec(
            "spec_mean_accepted_length", "gauge", "spec_decode_mean_accepted_length",
            "Tokens a verified draft yields on average, the target's own one included (since "
            "start; 0: nothing verified yet).",
            _W,
        ),
        # LoRA adapters (engine/lora/registry.py).
        MetricSpec(
            "lora_adapters", "gauge", "lora_adapters",
            "LoRA adapters the worker serves (kind=served), holds prepared in memory "
            "(resident) and may hold at once (max).",
            (*_W, "kind"),
        ),
        MetricSpec(
            "lora_adapter_resident", "gauge", "lora_adapter_resident",
            "1 while a served adapter is resident, 0 while it waits on disk.",
            (*_W, "adapter"),
        ),
        MetricSpec(
            "lora_loads", "counter", "lora_adapter_loads",
            "Adapters read from disk and prepared (registration included).",
            _W,
        ),
        MetricSpec(
            "lora_evictions", "counter", "lora_adapter_evictions",
            "Resident adapters evicted to make room for one a step needed.",
            _W,
        ),
        MetricSpec(
            "lora_swaps", "counter", "lora_adapter_swaps",
            "Loads a step waited for: its adapter had been evicted (of lora_adapter_loads).",
            _W,
        ),
        MetricSpec(
            "lora_requests", "counter", "lora_requests",
            "Requests admitted under each adapter.",
            (*_W, "adapter"),
        ),
    )  # fmt: skip


class WorkerMetrics:
    """One worker's metrics: labels role and model_name fixed."""

    __slots__ = (
        "families",
        "role",
        "model_name",
        "running",
        "waiting",
        "usage",
        "capacity",
        "wait_estimate",
        "prefill_rate",
        "_host_seen",
        "_spec_seen",
        "_lora_seen",
        "transfers_in_flight",
    )

    def __init__(self, families: WorkerFamilies, role: str, model_name: str) -> None:
        self.families = families
        self.role = role
        self.model_name = model_name
        self.running = families.num_requests_running.labels(role, model_name)
        self.waiting = families.num_requests_waiting.labels(role, model_name)
        self.usage = families.kv_cache_usage_perc.labels(role, model_name)
        self.capacity = families.kv_cache_capacity_tokens.labels(role, model_name)
        self.wait_estimate = families.queue_wait_estimate_seconds.labels(role, model_name)
        self.prefill_rate = families.prefill_throughput.labels(role, model_name)
        self._host_seen = (0, 0)  # the host tier's cumulative (hits, misses) already counted
        self._spec_seen: SpecCounts | None = None  # the counts already exported
        self._lora_seen = LoraStats((), (), 0, 0, 0)
        self.transfers_in_flight = 0  # KV transfers under way, either direction (Stats)

    def kv_capacity(self, num_blocks: int, block_size: int) -> None:
        self.capacity.set(num_blocks * block_size)

    def load(self, num_running: int, num_waiting: int, free_blocks: int, total_blocks: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.usage.set(1.0 - free_blocks / total_blocks if total_blocks else 0.0)

    def wait(self, queue_wait_s: float, prefill_tokens_per_s: float) -> None:
        self.wait_estimate.set(queue_wait_s)
        self.prefill_rate.set(prefill_tokens_per_s)

    def prefix_lookup(self, queried: int, remote_queried: int = 0, remote_hits: int = 0) -> None:
        """One prompt's lookup as it arrives, in blocks: the device tier's queries (its hits
        are counted at admission, `prefix_reused`), then the remote tier for the blocks the
        device lacked."""
        f, labels = self.families, (self.role, self.model_name)
        f.prefix_cache_queries.labels(*labels, TIER_DEVICE).inc(queried)
        if remote_queried:
            f.prefix_cache_queries.labels(*labels, TIER_REMOTE).inc(remote_queried)
            f.prefix_cache_hits.labels(*labels, TIER_REMOTE).inc(remote_hits)

    def prefix_reused(self, device_hits: int) -> None:
        """The blocks one request reused from the device pool when it was admitted."""
        f, labels = self.families, (self.role, self.model_name)
        f.prefix_cache_hits.labels(*labels, TIER_DEVICE).inc(device_hits)

    def host_tier(self, stats: HostTierStats | None) -> None:
        """The host tier's lookups since the last call, and its size."""
        if stats is None:
            return
        f, labels = self.families, (self.role, self.model_name)
        hits, misses = stats.hits - self._host_seen[0], stats.misses - self._host_seen[1]
        self._host_seen = (stats.hits, stats.misses)
        f.prefix_cache_queries.labels(*labels, TIER_HOST).inc(hits + misses)
        f.prefix_cache_hits.labels(*labels, TIER_HOST).inc(hits)
        f.host_tier_bytes.labels(*labels, "used").set(stats.used_bytes)
        f.host_tier_bytes.labels(*labels, "capacity").set(stats.capacity_bytes)

    def spec_decode(self, counts: SpecCounts | None) -> None:
        """The engine's cumulative speculation counts: what is new since the last call."""
        if counts is None:
            return
        f, labels = self.families, (self.role, self.model_name)
        seen = self._spec_seen or SpecCounts(0, 0, 0, (), ())
        self._spec_seen = counts
        f.spec_num_drafts.labels(*labels).inc(counts.num_drafts - seen.num_drafts)
        f.spec_num_draft_tokens.labels(*labels).inc(counts.num_draft_tokens - seen.num_draft_tokens)
        f.spec_num_accepted_tokens.labels(*labels).inc(
            counts.num_accepted_tokens - seen.num_accepted_tokens
        )
        rates = counts.acceptance_per_pos()
        for i, accepted in enumerate(counts.accepted_per_pos):
            if not counts.proposed_per_pos[i]:
                continue  # no draft reached this position yet
            before = seen.accepted_per_pos[i] if i < len(seen.accepted_per_pos) else 0
            f.spec_accepted_per_pos.labels(*labels, str(i)).inc(accepted - before)
            f.spec_acceptance_rate_per_pos.labels(*labels, str(i)).set(rates[i])
        f.spec_mean_accepted_length.labels(*labels).set(counts.mean_accepted_length)

    def lora(self, stats: LoraStats | None) -> None:
        """The engine's adapters now, and its cumulative counts: what is new since the last
        call. An adapter no longer served drops out of the per-adapter gauge."""
        if stats is None:
            return
        f, labels = self.families, (self.role, self.model_name)
        seen, self._lora_seen = self._lora_seen, stats
        f.lora_adapters.labels(*labels, "served").set(len(stats.known))
        f.lora_adapters.labels(*labels, "resident").set(len(stats.resident))
        f.lora_adapters.labels(*labels, "max").set(stats.max_loras)
        for name in set(seen.known) - set(stats.known):
            f.lora_adapter_resident.remove(*labels, name)
        for name in stats.known:
            f.lora_adapter_resident.labels(*labels, name).set(int(name in stats.resident))
        f.lora_loads.labels(*labels).inc(stats.loads - seen.loads)
        f.lora_evictions.labels(*labels).inc(stats.evictions - seen.evictions)
        f.lora_swaps.labels(*labels).inc(stats.swaps - seen.swaps)
        before = dict(seen.requests)
        for name, n in stats.requests:
            f.lora_requests.labels(*labels, name).inc(n - before.get(name, 0))

    def kv_integrity_failures(self, blocks: int) -> None:
        self.families.kv_integrity_failures.labels(self.role, self.model_name).inc(blocks)

    @contextlib.contextmanager
    def transferring(self, direction: str) -> Iterator[None]:
        """One KV transfer under way, for as long as the block lasts."""
        gauge = self.families.kv_transfers_in_flight.labels(self.role, self.model_name, direction)
        gauge.inc()
        self.transfers_in_flight += 1
        try:
            yield
        finally:
            self.transfers_in_flight -= 1
            gauge.dec()

    def writeback_skipped(self) -> None:
        self.families.kv_writeback_skipped.labels(self.role, self.model_name).inc()

    def remote_lookup_skipped(self) -> None:
        self.families.remote_lookups_skipped.labels(self.role, self.model_name).inc()

    def kv_transfer(self, direction: str, nbytes: int, blocks: int = 1) -> None:
        labels = (self.role, self.model_name, direction)
        self.families.kv_transfer_bytes.labels(*labels).inc(nbytes)
        self.families.kv_transfer_blocks.labels(*labels).inc(blocks)


def worker(role: int, model: str) -> WorkerMetrics:
    """`model` is the model directory; its name is the model_name label (as the frontend's
    default served name)."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    return WorkerMetrics(default_families(WorkerFamilies), role_label(role), name)
