"""logit_bias and the penalties against references nobody here wrote: HF transformers'
RepetitionPenaltyLogitsProcessor and SequenceBiasLogitsProcessor (through `generate`), and
for presence/frequency (which HF lacks) OpenAI's formula applied by hand, token by token, to
HF's raw logits. Greedy, so any difference in the processed logits shows as a token."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from rtp_serve.core.validation import InvalidRequestError
from rtp_serve.engine import SamplingParams
from tests.helpers import make_llm

PRESET = "tiny-llama"
N = 20


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir(PRESET))


def _ours(llm, prompts, **kw) -> list[list[int]]:
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, **kw)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _hf(hf_model, prompt, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model(PRESET).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=N,
            eos_token_id=None,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


def test_repetition_penalty_equals_hf(llm, hf_model, prompts) -> None:
    batch = prompts[:4]
    plain = _ours(llm, batch)
    ours = _ours(llm, batch, repetition_penalty=1.5)
    assert ours != plain  # the penalty changes these outputs
    for prompt, got in zip(batch, ours, strict=True):
        assert got == _hf(hf_model, prompt, repetition_penalty=1.5)
    # < 1 rewards repeats instead
    assert _ours(llm, batch[:1], repetition_penalty=0.7)[0] == _hf(
        hf_model, batch[0], repetition_penalty=0.7
    )


def test_logit_bias_equals_hf_sequence_bias(llm, hf_model, prompts) -> None:
    prompt = prompts[2]
    plain = _ours(llm, [prompt])[0]
    bias = {plain[1]: -100.0, 17: 4.0, 300: 6.5}
    [ours] = _ours(llm, [prompt], logit_bias=bias)
    assert ours != plain
    assert ours == _hf(hf_model, prompt, sequence_bias={(t,): b for t, b in bias.items()})


def _by_hand(hf_model, prompt, bias, rep, freq, pres) -> list[int]:
    """OpenAI's / vLLM's formulas in plain Python over HF's raw logits, one step at a time."""
    model = hf_model(PRESET)
    seq, out, past, step = list(prompt), [], None, list(prompt)
    for _ in range(N):
        with torch.inference_mode():
            hf = model(torch.tensor([step]), cache=past, use_cache=True)
        logits, past = hf.logits[0, -1].tolist(), hf.cache
        counts, seen = Counter(out), set(seq)  # seen: prompt or output so far
        for t in range(len(logits)):
            x = logits[t] + bias.get(t, 0.0)
            if t in seen:
                x = x / rep if x > 0 else x * rep
            x -= freq * counts[t] + pres * (counts[t] > 0)
            logits[t] = x
        token = max(range(len(logits)), key=logits.__getitem__)
        seq.append(token)
        out.append(token)
        step = [token]
    return out


def test_presence_frequency_and_all_together_equal_the_formula(llm, hf_model, prompts) -> None:
    prompt = prompts[1]
    cases = [
        {"freq": 1.5, "pres": 0.0, "rep": 1.0, "bias": {}},
        {"freq": 0.0, "pres": 2.0, "rep": 1.0, "bias": {}},
        {"freq": -0.5, "pres": 0.7, "rep": 1.2, "bias": {5: 3.0, 99: -2.0}},
    ]
    plain = _ours(llm, [prompt])[0]
    for c in cases:
        want = _by_hand(hf_model, prompt, c["bias"], c["rep"], c["freq"], c["pres"])
        [got] = _ours(
            llm,
            [prompt],
            frequency_penalty=c["freq"],
            presence_penalty=c["pres"],
            repetition_penalty=c["rep"],
            logit_bias=c["bias"],
        )
        assert got == want, c
        assert got != plain, c


def test_rows_without_penalties_keep_their_tokens_in_a_mixed_batch(llm, prompts) -> None:
    batch = prompts[:3]
    plain = _ours(llm, batch)
    mixed = llm.generate(
        batch,
        [
            SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, frequency_penalty=2),
            SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
        ],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == [plain[0], plain[2]]
    assert mixed[1].token_ids != plain[1]


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
    ],
)
def test_bad_values_name_the_field(kw, param) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kw)
    assert err.value.param == param


def test_logit_bias_beyond_the_vocabulary_is_refused(llm) -> None:
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={10**6: 1.0}))
    assert err.value.param == "logit_bias"
