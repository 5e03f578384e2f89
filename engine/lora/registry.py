"""Which adapters this engine serves, and which of them are resident (a bounded LRU).

Known adapters are checked when registered (config, and every tensor's name and shape
against the base model). At most `max_loras` are resident, prepared in the model's dtype on
its device; a step that needs one that is not is served by loading it again from its
directory, evicting the least recently used one no running step needs. The scheduler never
runs more than `max_loras` distinct adapters at once, so a step always fits.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import torch

from rtp_serve.core.model_config import ModelConfig
from rtp_serve.core.peft_config import LoraConfig, UnknownAdapterError
from rtp_serve.engine.lora.stacked import Stacked
from rtp_serve.engine.lora.stats import LoraStats
from rtp_serve.engine.lora.weights import LoraWeights, load_lora_weights

log = logging.getLogger(__name__)


class LoraRegistry:
    def __init__(
        self, model: ModelConfig, max_loras: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if max_loras <= 0:
            raise ValueError(f"max_loras must be positive, got {max_loras}")
        self.model = model
        self.max_loras = max_loras
        self.dtype = dtype
        self.device = device
        self.known: dict[str, LoraConfig] = {}
        self._resident: OrderedDict[str, LoraWeights] = OrderedDict()
        self._loads = 0
        self._evictions = 0
        self._swaps = 0
        self._requests: dict[str, int] = {}
        self._stacked: Stacked | None = None  # of the resident set; rebuilt when it changes

    def add(self, config: LoraConfig) -> None:
        """Serve `config` (raises AdapterError when it does not fit the model). Re-adding a
        name replaces it."""
        weights = self._load(config)  # checks it; kept resident if there is room
        self.remove(config.name, missing_ok=True)
        self.known[config.name] = config
        if len(self._resident) < self.max_loras:
            self._resident[config.name] = weights
            self._stacked = None

    def remove(self, name: str, missing_ok: bool = False) -> None:
        if self.known.pop(name, None) is None and not missing_ok:
            raise UnknownAdapterError(name)
        if self._resident.pop(name, None) is not None:
            self._stacked = None

    def get(self, name: str) -> LoraConfig:
        try:
            return self.known[name]
        except KeyError:
            raise UnknownAdapterError(name) from None

    def activate(self, names: Iterable[str]) -> dict[str, LoraWeights]:
        """Make every adapter of a step resident (most recently used), evicting others."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters, max_loras is {self.max_loras}")
        for name in wanted:
            if name in self._resident:
                self._resident.move_to_end(name)
                continue
            while len(self._resident) >= self.max_loras:
                victim = next(n for n in self._resident if n not in wanted)
                del self._resident[victim]
                self._evictions += 1
                log.debug("LoRA adapter %s evicted", victim)
            self._resident[name] = self._load(self.get(name))
            self._swaps += 1
            self._stacked = None
        return {name: self._resident[name] for name in wanted}

    def stacked(self) -> Stacked:
        """Every resident adapter side by side (stacked.py), slots in name order."""
        if self._stacked is None:
            self._stacked = Stacked.build([self._resident[n] for n in sorted(self._resident)])
        return self._stacked

    def count_request(self, name: str) -> None:
        """A request under adapter `name` was admitted (the per-adapter request counts)."""
        self._requests[name] = self._requests.get(name, 0) + 1

    def stats(self) -> LoraStats:
        return LoraStats(
            tuple(self.known),
            tuple(self._resident),
            self._loads,
            self._evictions,
            self._swaps,
            self.max_loras,
            tuple(sorted(self._requests.items())),
        )

    def _load(self, config: LoraConfig) -> LoraWeights:
        weights = load_lora_weights(config, self.model, self.dtype, self.device)
        self._loads += 1
        log.info(
            "LoRA adapter %s loaded from %s (rank %d, %s, %.1f MiB)",
            config.name,
            config.path,
            config.rank,
            ",".join(sorted(config.targets)),
            weights.nbytes / 2**20,
        )
        return weights
