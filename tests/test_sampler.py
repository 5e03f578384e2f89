"""The sampler's batch: every row's token and logprobs as if it were sampled alone (greedy,
seeded random draws with temperature, top-k, top-p), read back from the device in one copy
per step for the tokens and one more for logprobs, not one per row."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rtp_serve.engine import SamplingParams
from rtp_serve.engine import sampler as sampler_mod
from rtp_serve.engine.request import Request
from rtp_serve.engine.sampler import Sampler
from rtp_serve.engine.sampling_noise import draw

VOCAB = 50
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=1, logprobs=3),
    SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=1.2, top_k=5, seed=2),
    SamplingParams(temperature=0.7, top_p=0.6, seed=3, logprobs=2),
    SamplingParams(temperature=1.0, seed=4),
]


def _batch() -> tuple[torch.Tensor, list[Request]]:
    torch.manual_seed(0)
    requests = [
        Request(f"r{i}", list(range(3 + i)), p, block_size=16) for i, p in enumerate(PARAMS)
    ]
    return torch.randn(len(requests), VOCAB) * 3, requests


def test_each_row_is_sampled_as_if_alone():
    logits, requests = _batch()
    sampler = Sampler(eos_token_ids=(0,))
    batch = sampler(logits, requests)
    alone = [sampler(logits[i : i + 1], [r])[0] for i, r in enumerate(requests)]
    assert batch == alone
    lp = logits.log_softmax(-1)
    for i, (got, params) in enumerate(zip(batch, PARAMS, strict=True)):
        if params.greedy:
            assert got.token_id == int(logits[i].argmax())
        if params.logprobs is None:
            assert got.logprobs is None
            continue
        assert got.logprobs.token_id == got.token_id
        assert got.logprobs.logprob == float(lp[i, got.token_id])
        values, ids = torch.topk(lp[i], params.logprobs) if params.logprobs else ([], [])
        assert got.logprobs.top == dict(zip(list(map(int, ids)), map(float, values), strict=True))
    # A plain temperature row: its seeded draw from softmax(logits / T).
    plain = (logits[5] / PARAMS[5].temperature).softmax(-1)
    assert batch[5].token_id == draw(plain, 4, len(requests[5].token_ids))
    # top-k: only the k largest can be drawn.
    assert batch[3].token_id in torch.topk(logits[3], 5).indices.tolist()


@pytest.mark.parametrize("logprobs,copies", [(False, 1), (True, 2)])
def test_a_step_reads_the_device_once_for_tokens_and_once_for_logprobs(
    monkeypatch, logprobs, copies
):
    """Not once per row: on a GPU each copy waits for the device."""
    logits, requests = _batch()
    if not logprobs:
        for r in requests:
            r.params = dataclasses.replace(r.params, logprobs=None)
    calls = []

    def counted(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.shape)
        return t.cpu()

    monkeypatch.setattr(sampler_mod, "to_host", counted)
    Sampler(eos_token_ids=(0,))(logits, requests)
    assert len(calls) == copies
