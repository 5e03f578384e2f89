"""The trained smollm2-135m served by a launched cluster (PD and fused), through the official
`openai` client: the chat answer equals the offline engine's, streamed and not."""

from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from tests.cluster import launch

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def offline(smollm2) -> tuple[str, str]:
    """(text, finish_reason) of the in-process engine for the question."""
    llm = LLM(str(smollm2), num_kv_blocks=64)
    text = llm.tokenizer.apply_chat_template(QUESTION)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)  # as the frontend encodes
    [out] = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return out.text, out.finish_reason


@pytest.fixture(scope="module", params=["pd", "fused"])
def cluster(request, smollm2, tmp_path_factory):
    flags = ("--prefill", "1", "--decode", "1") if request.param == "pd" else ("--fused", "1")
    with launch(str(smollm2), tmp_path_factory.mktemp(request.param), *flags) as c:
        yield c
    assert c.left_running == []


def test_chat_answer_equals_offline_engine(cluster, offline, smollm2):
    text, reason = offline
    assert text == "The capital of France is Paris."
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)
    [model] = client.models.list().data
    assert model.id == smollm2.name  # smollm2-135m-v1: the model directory's name
    out = client.chat.completions.create(
        model=model.id, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].message.content == text
    assert out.choices[0].finish_reason == reason
    stream = client.chat.completions.create(
        model=model.id, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
