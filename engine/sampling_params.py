"""Per-request sampling parameters, validated when built (a bad field raises InvalidRequestError,
a ValueError naming it)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec.adaptive import MAX_SPECULATIVE_TOKENS
from engine.structured import StructuredOutputs
from engine.validation import InvalidRequestError


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
    # The output must match this grammar (JSON schema, regex, choice, ...): engine/structured.py.
    structured: StructuredOutputs | None = None
    # Speculative decoding (engine/spec/), where the engine runs it: at most this many draft
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
        if not self.temperature >= 0:  # also rejects NaN
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
