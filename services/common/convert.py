"""Protobuf <-> engine conversions for sampling parameters and logprobs: the one mapping of
each (torch-free)."""

from __future__ import annotations

from typing import Any

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from services.common.pb import common_pb2


def params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def params_fields_from_pb(msg: common_pb2.SamplingParams) -> dict[str, Any]:
    """SamplingParams' fields from the message; proto3 zeros mean "unset" where zero is not
    a valid value (top_k 0: disabled, top_p 0: 1; max_tokens 0 is left for the caller)."""
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
    }


def params_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (naming the field) for invalid parameters."""
    return SamplingParams(**params_fields_from_pb(msg))


def logprob_to_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top.items()],
    )


def logprob_from_pb(msg: common_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, {t.token_id: t.logprob for t in msg.top})
