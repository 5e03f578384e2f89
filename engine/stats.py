"""What an engine reports about itself: load and the leak check (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rtp_serve.engine.host_tier import HostTierStats
    from rtp_serve.engine.lora.stats import LoraStats
    from rtp_serve.engine.spec_decode.stats import SpecCounts


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for load reports and metrics."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_queued_tokens: int  # prompt/recompute tokens not yet computed
    host_tier: HostTierStats | None = None  # T1, where configured
    spec: SpecCounts | None = None  # speculative decoding, where configured
    loras: LoraStats | None = None  # LoRA adapters served and resident


@dataclass(frozen=True, slots=True)
class EngineCheck:
    """A worker's answer to "is anything leaking?": stats, held blocks, integrity."""

    stats: EngineStats
    num_held_blocks: int  # blocks some request references right now
    integrity_error: str  # empty when every invariant holds
