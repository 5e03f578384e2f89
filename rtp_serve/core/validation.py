"""Checks of a request against the model, shared by the engine and the frontend (torch-free),
so a bad request gets the same message wherever it is caught."""

from __future__ import annotations

from collections.abc import Sequence


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (API error bodies)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_prompt(
    token_ids: Sequence[int], vocab_size: int, context_len: int, param: str = "prompt"
) -> None:
    if not token_ids:
        raise InvalidRequestError("the prompt must not be empty", param)
    # The length first: a prompt far too long is refused without scanning every element.
    if len(token_ids) >= context_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {context_len} tokens, but the prompt has "
            f"{len(token_ids)} tokens (it must be shorter, to leave room for the output)",
            param,
        )
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)]
    bad += [t for t in token_ids if isinstance(t, int) and not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}", param
        )


def check_stop_token_ids(stop_token_ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"stop_token_ids out of range [0, {vocab_size}): {bad[:5]}", "stop_token_ids"
        )


def check_logit_bias(logit_bias: Sequence[tuple[int, float]], vocab_size: int) -> None:
    bad = [t for t, _ in logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"logit_bias token ids out of range [0, {vocab_size}): {bad[:5]}", "logit_bias"
        )


def check_speculative_advice(advice: Sequence[int], vocab_size: int, context_len: int) -> None:
    # Longer than the context it cannot help (the output fits in the context), and a worker
    # searches it every step: refused by its length before any element is looked at.
    if len(advice) > context_len:
        raise InvalidRequestError(
            f"speculative_advice has {len(advice)} tokens; at most {context_len} (the model's "
            "context length) are allowed",
            "speculative_advice",
        )
    # Negative ids are refused by SamplingParams itself; only the vocabulary bound is model-bound.
    if any(t >= vocab_size for t in advice):
        raise InvalidRequestError(
            f"speculative_advice has token ids outside the vocabulary ({vocab_size})",
            "speculative_advice",
        )
