"""Protobuf <-> engine conversions for sampling parameters, structured-output specs and
logprobs: the one mapping of each (torch-free)."""

from __future__ import annotations

import math
from typing import Any

from rtp_serve.core.outputs import TokenLogprobs
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.structured import GuideKind, StructuredOutputs
from rtp_serve.core.tenant import DEFAULT_TENANT, TenantShare
from rtp_serve.core.validation import InvalidRequestError
from rtp_serve.services.common.pb import common_pb2, worker_pb2


def params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=dict(p.logit_bias),
        speculative_advice=p.speculative_advice,
    )
    if p.num_speculative_tokens is not None:
        msg.num_speculative_tokens = p.num_speculative_tokens
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def params_fields_from_pb(msg: common_pb2.SamplingParams) -> dict[str, Any]:
    """SamplingParams' fields from the message; proto3 zeros mean "unset" where zero is not
    a valid value (top_k 0: disabled, top_p 0: 1, repetition_penalty 0: 1; max_tokens 0 is
    left for the caller). A proto float may be inf or NaN, which JSON cannot carry: every
    one is checked here, at the gRPC boundary (InvalidRequestError naming the field)."""
    for name in _FLOAT_FIELDS:
        _check_finite(name, getattr(msg, name))
    for token, value in msg.logit_bias.items():
        _check_finite(f"logit_bias[{token}]", value, "logit_bias")
    return {
        "max_tokens": msg.max_tokens,
        "temperature": msg.temperature,
        "top_k": msg.top_k if msg.top_k != 0 else -1,
        "top_p": msg.top_p if msg.top_p != 0 else 1.0,
        "seed": msg.seed if msg.HasField("seed") else None,
        "stop_token_ids": tuple(msg.stop_token_ids),
        "ignore_eos": msg.ignore_eos,
        "min_tokens": msg.min_tokens,
        "logprobs": msg.logprobs if msg.HasField("logprobs") else None,
        "presence_penalty": msg.presence_penalty,
        "frequency_penalty": msg.frequency_penalty,
        "repetition_penalty": msg.repetition_penalty or 1.0,
        "logit_bias": dict(msg.logit_bias),
        "num_speculative_tokens": (
            msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else None
        ),
        "speculative_advice": tuple(msg.speculative_advice),
    }


def _check_finite(name: str, value: float, param: str | None = None) -> None:
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value}", param or name)


def params_from_pb(
    msg: common_pb2.SamplingParams, structured: worker_pb2.StructuredOutput | None = None
) -> SamplingParams:
    """Raises ValueError (naming the field) for invalid parameters. `structured`: the
    request's grammar (a message field that is unset reads as None)."""
    return SamplingParams(**params_fields_from_pb(msg), structured=structured_from_pb(structured))


def structured_to_pb(so: StructuredOutputs | None) -> worker_pb2.StructuredOutput | None:
    if so is None:
        return None
    msg = worker_pb2.StructuredOutput(resume_tokens=so.resume_tokens)
    match so.kind:
        case GuideKind.JSON:
            msg.json_schema = so.spec
        case GuideKind.JSON_OBJECT:
            msg.json_object = True
        case GuideKind.REGEX:
            msg.regex = so.spec
        case GuideKind.CHOICE:
            msg.choice.choices.extend(so.choices)
        case GuideKind.GRAMMAR:
            msg.grammar = so.spec
    return msg


def structured_from_pb(msg: worker_pb2.StructuredOutput | None) -> StructuredOutputs | None:
    """None for no message, or a message with no kind set (an unset field)."""
    kind = None if msg is None else msg.WhichOneof("kind")
    if kind is None:
        return None
    resume = msg.resume_tokens
    match kind:
        case "json_schema":
            return StructuredOutputs(GuideKind.JSON, msg.json_schema, resume_tokens=resume)
        case "json_object":
            return StructuredOutputs(GuideKind.JSON_OBJECT, resume_tokens=resume)
        case "regex":
            return StructuredOutputs(GuideKind.REGEX, msg.regex, resume_tokens=resume)
        case "choice":
            choices = tuple(msg.choice.choices)
            return StructuredOutputs(GuideKind.CHOICE, choices=choices, resume_tokens=resume)
        case _:
            return StructuredOutputs(GuideKind.GRAMMAR, msg.grammar, resume_tokens=resume)


def logprob_to_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top.items()],
    )


def logprob_from_pb(msg: common_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, {t.token_id: t.logprob for t in msg.top})


def tenant_to_pb(tenant: TenantShare) -> worker_pb2.Tenant:
    return worker_pb2.Tenant(name=tenant.name, weight=tenant.weight)


def tenant_from_pb(msg: worker_pb2.Tenant) -> TenantShare:
    """A request's tenant (unset: the default one); InvalidRequestError naming `tenant` for a
    weight that is negative or not finite."""
    weight = msg.weight or 1.0
    if not (math.isfinite(weight) and weight > 0):
        raise InvalidRequestError(f"tenant weight must be positive, got {weight}", "tenant")
    return TenantShare(msg.name or DEFAULT_TENANT, weight)
