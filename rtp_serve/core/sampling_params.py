"""Per-request sampling parameters, validated when built (a bad field raises InvalidRequestError,
a ValueError naming it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rtp_serve.core.structured import StructuredOutputs
from rtp_serve.core.validation import InvalidRequestError

MAX_SPECULATIVE_TOKENS = 16  # per request and per server


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Return the log-probability of each sampled token plus this many top alternatives.
    logprobs: int | None = None
    # The output must match this grammar (JSON schema, regex, choice, ...): rtp_serve/core/structured.py.
    structured: StructuredOutputs | None = None
    # Logits processing (engine/logits_processors.py), vLLM's semantics: presence and
    # frequency over the output, repetition over prompt and output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs added to the logits; a dict is taken too.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Speculative decoding (engine/spec_decode/), where the engine runs it: at most this many draft
    # tokens a step (None: the engine's setting; 0: off for this request). `advice`: token
    # ids the output is expected to repeat (an edited file), searched first for drafts.
    num_speculative_tokens: int | None = None
    speculative_advice: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        def bad(field: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{field} {message}", field)

        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens <= 0
        ):
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not 0 <= self.temperature < float("inf"):  # also rejects NaN
            raise bad("temperature", f"must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", f"must be >= 0, got {self.logprobs}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise bad("structured", f"must be a StructuredOutputs, got {self.structured!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be non-negative integers: {self.stop_token_ids}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, Mapping) else tuple(map(tuple, bias))
        for token, value in pairs:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise bad("logit_bias", f"keys must be token ids, got {token!r}")
            if not -100.0 <= value <= 100.0:
                raise bad("logit_bias", f"values must be in [-100, 100], got {value}")
        k = self.num_speculative_tokens
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS
        ):
            raise bad(
                "num_speculative_tokens", f"must be in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.speculative_advice):
            raise bad("speculative_advice", "must be non-negative token ids")
        # Tuples keep the object hashable and immutable even if a list was passed.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "speculative_advice", tuple(self.speculative_advice))
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty or bias applies (engine/logits_processors.py)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
