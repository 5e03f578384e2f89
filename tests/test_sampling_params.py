"""SamplingParams validation: every bad field raises a ValueError that names it."""

import dataclasses

import pytest

from rtp_serve.core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_tokens": 17}, "min_tokens"),  # default max_tokens is 16
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": (3, -2)}, "stop_token_ids"),
    ],
)
def test_invalid_field_raises_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"temperature": 0.0},
        {"min_tokens": 16},
        {"logprobs": 0},
        {"stop_token_ids": (0,)},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_stop_token_ids_become_a_tuple_and_params_are_frozen():
    params = SamplingParams(stop_token_ids=[5, 6])
    assert params.stop_token_ids == (5, 6)
    assert hash(params) == hash(SamplingParams(stop_token_ids=(5, 6)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 3


def test_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=50).greedy
