"""What the engine reports for a request after a step (immutable; safe to hand to other threads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.request import FINISH_REASONS, Request, TokenLogprobs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class PromptKV:
    """KV of prompt positions [start, start + n) of a finished prefill-only request."""

    start: int
    k: torch.Tensor  # [layers, n, kv_heads, head_dim]
    v: torch.Tensor


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    new_token_ids: list[int]  # the ones added since the previous output for this request
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_cached_tokens: int
    stop_reason: int | None = None
    text: str = ""
    prompt_kv: PromptKV | None = None  # only for requests made with export_kv_from

    @classmethod
    def from_request(
        cls, request: Request, num_new: int, prompt_kv: PromptKV | None = None
    ) -> RequestOutput:
        out = request.output_token_ids
        finished = request.status.finished
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=out,
            new_token_ids=out[len(out) - num_new :] if num_new else [],
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
            finished=finished,
            finish_reason=FINISH_REASONS.get(request.status) if finished else None,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            stop_reason=request.stop_reason,
            prompt_kv=prompt_kv,
        )
