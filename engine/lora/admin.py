"""Serving and retiring LoRA adapters while requests run, and the cache salt of each.

The registry (registry.py) knows adapters and keeps some resident; this is the engine's
admin over it: an adapter a queued or running request uses is never replaced or removed
(that request's KV was made under it), and each adapter salts its own block-hash namespace
(core.block_hash.salt_of) so KV made under one never serves another.
"""

from __future__ import annotations

from collections.abc import Mapping

from rtp_serve.core.block_hash import salt_of
from rtp_serve.core.peft_config import LoraConfig
from rtp_serve.engine.lora.registry import LoraRegistry, LoraStats
from rtp_serve.engine.request import Request


class LoraAdmin:
    def __init__(
        self,
        registry: LoraRegistry,
        requests: Mapping[str, Request],
        model_id: str,
        numerics: str,
    ) -> None:
        self.registry = registry
        self._requests = requests  # the scheduler's live requests, by id (read only)
        self._model_id = model_id
        self._numerics = numerics
        self.base_salt = salt_of(model_id, numerics)  # the base model's namespace

    def salt_for(self, lora: str = "") -> bytes:
        """The block-hash salt of requests under `lora` ("" the base model)."""
        if not lora:
            return self.base_salt
        return salt_of(self._model_id, self._numerics, self.registry.get(lora).fingerprint)

    def add(self, config: LoraConfig) -> None:
        """Serve an adapter (AdapterError if it does not fit this model). Replacing a name
        in use by a request is refused: that request's KV was made under the old one."""
        if config.name in self.registry.known:
            self._check_unused(config.name)
        self.registry.add(config)

    def remove(self, name: str) -> None:
        """Stop serving an adapter (UnknownAdapterError; ValueError while in use)."""
        self.registry.get(name)
        self._check_unused(name)
        self.registry.remove(name)

    def stats(self) -> LoraStats:
        return self.registry.stats()

    def _check_unused(self, name: str) -> None:
        users = sum(1 for r in self._requests.values() if r.lora == name)
        if users:
            raise ValueError(f"the LoRA adapter `{name}` is in use by {users} requests")
