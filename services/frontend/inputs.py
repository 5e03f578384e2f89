"""Step 1 of a request: what the client asked for (`Options`, from either ingress) checked
against the model and turned into one wire-ready `GenerateInput` per choice."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.structured import StructuredOutputs
from rtp_serve.core.validation import (
    InvalidRequestError,
    check_logit_bias,
    check_prompt,
    check_speculative_advice,
    check_stop_token_ids,
)
from rtp_serve.services.common.convert import params_to_pb, structured_to_pb
from rtp_serve.services.common.pb import common_pb2, worker_pb2
from rtp_serve.services.frontend.errors import invalid
from rtp_serve.services.frontend.limits import Limits
from rtp_serve.services.frontend.model_info import ModelInfo
from rtp_serve.services.frontend.tenant_limits import TenantLease

_INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class Options:
    """What a client asks for, whichever ingress it came through. The sampling fields carry
    SamplingParams' names (and so build one), plus what only the frontend acts on."""

    max_tokens: int | None = None  # None: the ingress's default, capped by the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per token; 0: only the sampled token's
    structured: StructuredOutputs | None = None  # validated by the ingress
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    num_speculative_tokens: int | None = None  # None: the workers' setting; 0: off
    speculative_advice: tuple[int, ...] = ()  # token ids (the HTTP ingress tokenizes text)
    n: int = 1
    best_of: int | None = None  # completions: candidates to generate, the best n returned
    session_id: str = ""
    priority: int = 0
    timeout: float | None = None  # seconds from now; None: no deadline
    lora: str = ""  # the LoRA adapter `model` named ("" the base model), resolved by the ingress


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """One sequence to generate: validated, ready for the wire."""

    request_id: str
    prompt_token_ids: list[int]
    params: common_pb2.SamplingParams
    structured: worker_pb2.StructuredOutput | None = None
    stop: tuple[str, ...] = ()
    session_id: str = ""
    priority: int = 0
    timeout: float | None = None  # as the client gave it
    deadline: float | None = None  # time.monotonic() when the request gives up
    lora: str = ""  # the LoRA adapter to run under ("" the base model)
    # Its tenant's admission (set by the ingress after prepare): the share the workers
    # schedule by, the output tokens it takes, the tenant's metrics. None: the default's.
    tenant: TenantLease | None = None

    def remaining(self) -> float | None:
        """Seconds left before the deadline (<= 0: passed); None without one."""
        return None if self.deadline is None else self.deadline - time.monotonic()


_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def prepare(
    model: ModelInfo,
    limits: Limits,
    request_id: str,
    prompt_ids: Sequence[int],
    opts: Options,
    default_max_tokens: int | None,
    prompt_param: str = "prompt",
    logprobs_param: str = "logprobs",
) -> list[GenerateInput]:
    """One GenerateInput per choice (per candidate with `best_of`); raises
    FrontendError(INVALID) naming the parameter.
    `default_max_tokens` None: as many as the context leaves room for."""
    vocab, limit, n_prompt = model.vocab_size, model.context_len, len(prompt_ids)
    try:
        check_prompt(prompt_ids, vocab, limit, prompt_param)
    except InvalidRequestError as exc:
        raise invalid(str(exc), exc.param) from None
    most = limits.prompt_limit(limit)
    if n_prompt > most:
        raise invalid(
            f"the prompt has {n_prompt} tokens; this server's limit is {most}", prompt_param
        )
    room = limit - n_prompt
    if limits.max_tokens is not None:
        room = min(room, limits.max_tokens)
    max_tokens = opts.max_tokens
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise invalid(
            f"max_tokens is {max_tokens}; this server's limit is {limits.max_tokens}", "max_tokens"
        )
    elif max_tokens > room:
        raise invalid(
            f"This model's maximum context length is {limit} tokens, but {n_prompt + max_tokens}"
            f" were requested ({n_prompt} in the prompt, {max_tokens} for the completion)",
            "max_tokens",
        )
    if not 1 <= opts.n <= limits.max_n:
        raise invalid(f"n must be between 1 and {limits.max_n}, got {opts.n}", "n")
    candidates = opts.n if opts.best_of is None else opts.best_of
    if not opts.n <= candidates <= limits.max_n:
        raise invalid(
            f"best_of must be between n ({opts.n}) and {limits.max_n}, got {candidates}",
            "best_of",
        )
    limits.check_logprobs(opts.logprobs, logprobs_param)
    limits.check_stop(opts.stop)
    if opts.seed is not None and not _INT64[0] <= opts.seed <= _INT64[1] - candidates:
        raise invalid(f"seed must be a 64-bit integer, got {opts.seed}", "seed")
    try:
        # Before SamplingParams scans it: an advice longer than the context is refused by length.
        check_speculative_advice(opts.speculative_advice, vocab, limit)
        sampling = {f: getattr(opts, f) for f in _SAMPLING_FIELDS} | {"max_tokens": max_tokens}
        if candidates > opts.n and opts.logprobs is None:
            sampling["logprobs"] = 0  # the candidates are ranked by their tokens' logprobs
        params = SamplingParams(**sampling)
        check_stop_token_ids(params.stop_token_ids, vocab)
        check_logit_bias(params.logit_bias, vocab)
    except InvalidRequestError as exc:
        raise invalid(str(exc), exc.param) from None
    if opts.timeout is not None and not opts.timeout > 0:
        raise invalid(f"timeout must be a number of seconds > 0, got {opts.timeout}", "timeout")
    deadline = None if opts.timeout is None else time.monotonic() + opts.timeout
    inputs = []
    for i in range(candidates):
        # n choices with one seed would be n copies: choice i samples with seed + i.
        p = params if params.seed is None else replace(params, seed=params.seed + i)
        rid = request_id if candidates == 1 else f"{request_id}-{i}"
        inputs.append(
            GenerateInput(
                rid,
                list(prompt_ids),
                params_to_pb(p),
                structured_to_pb(p.structured),
                opts.stop,
                opts.session_id,
                opts.priority,
                opts.timeout,
                deadline,
                opts.lora,
            )
        )
    return inputs
