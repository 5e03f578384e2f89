"""The trained smollm2-135m served by a launched cluster (PD and fused), through the official
`openai` client: the chat answer equals the offline engine's, streamed and not."""

from __future__ import annotations

import openai
import pytest

from rtp_serve.engine import LLM, SamplingParams
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


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_outputs_through_the_openai_client(cluster):
    """json_schema, streamed and not, greedy and sampled; a vLLM extra; a length cut. In PD
    the prefill worker samples the first token under the grammar and the decode worker
    advances its own past it."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Give a person as JSON."}]
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    texts = []
    for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
        out = client.chat.completions.create(
            model=model, messages=ask, max_tokens=32, response_format=fmt, **kw
        )
        assert out.choices[0].finish_reason == "stop"
        texts.append(out.choices[0].message.content)
        jsonschema.validate(json.loads(texts[-1]), PERSON)
    stream = client.chat.completions.create(
        model=model, messages=ask, max_tokens=32, response_format=fmt, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == texts[0]
    choice = client.completions.create(
        model=model,
        prompt="Q: Is the sky blue? A:",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    cut = client.chat.completions.create(
        model=model, messages=ask, max_tokens=3, response_format=fmt, temperature=0
    )
    assert cut.choices[0].finish_reason == "length"
    assert texts[0].startswith(cut.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.chat.completions.create(
            model=model, messages=ask, max_tokens=3, extra_body={"guided_regex": "[a-"}
        )
    for stats in cluster.wait_idle().values():
        assert stats.held_blocks == 0 and stats.integrity_ok
