"""The conditional-disaggregation threshold from measured rates (core/cost_model.py), on
binary-exact inputs: arithmetic, no clocks."""

import pytest

from rtp_serve.core.cost_model import FetchCost, local_prefill_threshold

# 1,024 tokens/s on the decode worker; 256 B of KV a token over 1 MiB/s: a token costs
# 2**-10 s to compute and 2**-12 s to move, so moving saves 3 * 2**-12 s a token.
P, B, BYTE_S = 1024.0, 256.0, 2.0**-20


def test_break_even_is_latency_over_the_saving_per_token():
    assert local_prefill_threshold(P, FetchCost(0.75, BYTE_S), B) == 1024  # 0.75 / (3 * 2**-12)


def test_rounds_up_to_a_whole_token():
    assert local_prefill_threshold(P, FetchCost(0.75 + 2**-12, BYTE_S), B) == 1025  # 1024 + 1/3


def test_no_latency_sends_every_prompt_to_a_prefill_worker():
    assert local_prefill_threshold(P, FetchCost(0.0, BYTE_S), B) == 0


def test_a_link_slower_than_the_prefill_keeps_every_prompt_local():
    assert local_prefill_threshold(P, FetchCost(0.01, 4 * BYTE_S), B) is None  # 2**-10 each way
    assert local_prefill_threshold(P, FetchCost(0.01, 8 * BYTE_S), B) is None


def test_a_fuller_decode_batch_lowers_the_threshold():
    # Two streams stall: local costs 2**-9 s a token, moving saves 7 * 2**-12.
    assert local_prefill_threshold(P, FetchCost(0.875, BYTE_S), B, decode_rows=2) == 512
    assert local_prefill_threshold(P, FetchCost(0.01, 4 * BYTE_S), B, decode_rows=2) == 11


@pytest.mark.parametrize(
    ("rate", "transfer", "per_token", "rows"),
    [
        (0.0, FetchCost(0.1, BYTE_S), B, 1),
        (P, FetchCost(), B, 1),
        (P, FetchCost(0.1, BYTE_S), 0.0, 1),
        (P, FetchCost(0.1, BYTE_S), B, 0),
    ],
)
def test_unmeasured_inputs_are_refused(rate, transfer, per_token, rows):
    with pytest.raises(ValueError):
        local_prefill_threshold(rate, transfer, per_token, rows)
