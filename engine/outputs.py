"""What the engine hands out: sampled tokens, per-step output deltas, whole offline results.

Every output is immutable, so it is safe to hand to other threads. A step's `RequestOutput`
carries only what is new for its request (vLLM's `new_token_ids`): streaming a request of n
tokens copies O(n), not O(n^2). Whoever needs the whole sequence keeps it, for example with
an `OutputCollector` (as `LLM.generate` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rtp_serve.core.outputs import TokenLogprobs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class PromptKV:
    """KV of prompt positions [start, start + n) of a request, as the cache stores it.

    An int8 cache's KV carries the scales of the blocks it covers, [layers, blocks, kv_heads]
    float32 each (rtp_serve/kernels/kv_quant.py); `start` is then a multiple of the block size.
    """

    start: int
    k: torch.Tensor  # [layers, n, kv_heads, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        tensors = (self.k, self.v, self.k_scale, self.v_scale)
        return sum(t.nbytes for t in tensors if t is not None)  # torch tensors or numpy arrays


@dataclass(frozen=True, slots=True)
class StagedKV:
    """Whole prompt blocks a lower KV tier gave a queued request: their keys and KV."""

    block_hashes: list[bytes]
    kv: PromptKV  # covers len(block_hashes) whole blocks (its start is ignored)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What changed for one request in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None  # None: logprobs were not asked for
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int  # all output tokens so far, these included
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    stop_reason: int | None = None  # the stop token id that ended it
    prompt_kv: PromptKV | None = None  # the last output of a request made with export_kv_from
    # PD decode side: blocks are reserved (num_cached_tokens of them already hold this
    # prompt's KV) and the request waits for the rest of the prompt's KV from a prefill worker.
    waiting_for_kv: bool = False
    # On the output with the first token only: seconds from its arrival to its first step
    # (admitted), and from then to this output.
    queue_s: float | None = None
    prefill_s: float | None = None


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """A whole finished request (offline `LLM.generate`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    stop_reason: int | None = None
    text: str = ""
    prompt_kv: PromptKV | None = None


@dataclass(slots=True)
class OutputCollector:
    """Joins one request's deltas back into its whole output."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(out.new_logprobs)
        self.last = out

    def result(self, text: str = "") -> CompletionOutput:
        last = self.last
        assert last is not None, "no output collected"
        return CompletionOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids),
            logprobs=self.logprobs,
            finished=last.finished,
            finish_reason=last.finish_reason,
            num_cached_tokens=last.num_cached_tokens,
            stop_reason=last.stop_reason,
            text=text,
            prompt_kv=last.prompt_kv,
        )
