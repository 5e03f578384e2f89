"""What the frontend knows about the served model, read once at start-up (torch-free)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rtp_serve.core.model_config import ModelConfig
from rtp_serve.services.frontend.errors import ErrorKind, FrontendError


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The model's tokenizer-side facts. Its KV namespace (block size, cache salt) is the
    workers': the frontend learns it from their registration (router_client.Membership)."""

    path: str
    served_name: str
    vocab_size: int
    context_len: int
    byte_level: bool  # the tokenizer is a byte-level BPE (token bytes are recoverable)

    @classmethod
    def load(
        cls, path: str, served_name: str | None = None, max_model_len: int | None = None
    ) -> ModelInfo:
        cfg = ModelConfig.from_dir(path)
        return cls(
            path=path,
            served_name=served_name or Path(path).name,
            vocab_size=cfg.vocab_size,
            context_len=max_model_len or cfg.max_position_embeddings,
            byte_level=_byte_level_decoder(Path(path) / "tokenizer.json"),
        )


def _byte_level_decoder(tokenizer_json: Path) -> bool:
    try:
        decoder = json.loads(tokenizer_json.read_text()).get("decoder") or {}
    except (OSError, ValueError):
        return False
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(d.get("type") == "ByteLevel" for d in parts)


class Admission:
    """Requests in flight: a bound on their number (beyond it, refuse at once rather than
    queue), and their ids unique (a client retrying a request it gave an id to, while the
    first attempt still runs, is refused rather than served twice)."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"max concurrent requests must be positive, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self._ids: set[str] = set()

    @contextlib.contextmanager
    def admit(self, request_id: str | None = None) -> Iterator[None]:
        if self.in_flight >= self.limit:
            raise FrontendError(
                ErrorKind.OVERLOADED,
                f"the server is at its limit of {self.limit} concurrent requests; retry later",
                code="rate_limit_exceeded",
            )
        if request_id is not None and request_id in self._ids:
            raise FrontendError(
                ErrorKind.CONFLICT,
                f"a request with id {request_id!r} is already in flight; wait for it to end "
                "(or send another id)",
                code="duplicate_request_id",
            )
        self.in_flight += 1
        if request_id is not None:
            self._ids.add(request_id)
        try:
            yield
        finally:
            self.in_flight -= 1
            self._ids.discard(request_id)
