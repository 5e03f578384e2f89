"""Tool calling and the sampling surface on a launched smollm2-135m cluster (PD and fused),
through the official `openai` client: calls validated with jsonschema, streamed calls
accumulated by the client's own ChatCompletionStreamState, penalties and logit_bias against
the offline engine (in PD the prefill worker samples the first token with them)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.services.frontend.tool_calls import parse_all
from tests.cluster import launch
from tests.test_tool_calls import WEATHER

jsonschema = pytest.importorskip("jsonschema")

TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 24}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time now", "parameters": TIME},
    },
]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module", params=["pd", "fused"])
def cluster(request, smollm2, tmp_path_factory):
    flags = ("--prefill", "1", "--decode", "1") if request.param == "pd" else ("--fused", "1")
    with launch(str(smollm2), tmp_path_factory.mktemp(request.param), *flags) as c:
        yield c
    assert c.left_running == []


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=90)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _validate(call) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_required_always_yields_calls_that_validate(client, model) -> None:
    kw = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    for sampling in (
        {"temperature": 0},
        {"temperature": 1.0, "seed": 1},
        {"temperature": 1.0, "seed": 2},
    ):
        out = client.chat.completions.create(
            max_tokens=96, parallel_tool_calls=False, **kw, **sampling
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        _validate(call)
    # Parallel: this small model repeats calls until max_tokens cuts the last one off.
    out = client.chat.completions.create(max_tokens=96, temperature=0, **kw)
    calls = out.choices[0].message.tool_calls
    finish = out.choices[0].finish_reason
    assert finish in ("tool_calls", "length") and len(calls) > (finish == "length")
    for call in calls[:-1] if finish == "length" else calls:
        _validate(call)


def test_streamed_call_accumulates_to_the_whole_one(client, model) -> None:
    kw = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    kw |= {"max_tokens": 96, "temperature": 0, "parallel_tool_calls": False}
    whole = client.chat.completions.create(**kw).choices[0]
    state = ChatCompletionStreamState()
    fragments = 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        fragments += sum(1 for d in (chunk.choices[0].delta.tool_calls or []) if not d.id)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert _calls(streamed.message) == _calls(whole.message) and len(_calls(whole.message)) == 1
    assert fragments > 1  # the arguments arrive as they are generated
    _validate(streamed.message.tool_calls[0])


def test_named_function_is_the_one_called(client, model) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=64, temperature=0
    )
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and out.choices[0].finish_reason == "tool_calls"
    _validate(call)


# An earlier turn shows the model a call; it writes one for the new question itself.
LONDON = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "London", "unit": "celsius"}'},
}
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [LONDON]},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def test_auto_is_the_parse_of_what_the_model_wrote(client, model) -> None:
    """tool_choice none returns the raw text; auto returns that text parsed (a call when the
    model wrote a valid Hermes block, else the same content), streamed or not."""
    kw = {"model": model, "tools": TOOLS, "max_tokens": 64, "temperature": 0}
    called = []
    for messages in (ASK, [{"role": "user", "content": "Say hello."}], FEW_SHOT):
        raw = client.chat.completions.create(messages=messages, tool_choice="none", **kw)
        auto = client.chat.completions.create(messages=messages, tool_choice="auto", **kw)
        content, calls = parse_all(["get_weather", "get_time"], raw.choices[0].message.content)
        assert auto.choices[0].message.content == content
        assert _calls(auto.choices[0].message) == [(c.name, c.arguments) for c in calls]
        finish = "tool_calls" if calls else raw.choices[0].finish_reason
        assert auto.choices[0].finish_reason == finish
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
            state.handle_chunk(chunk)
        streamed = state.get_final_completion().choices[0]
        assert (streamed.message.content or None, _calls(streamed.message)) == (
            content,
            _calls(auto.choices[0].message),
        )
        called += auto.choices[0].message.tool_calls or []
    [call] = called  # the few-shot turn
    assert call.function.name == "get_weather" and "Paris" in call.function.arguments
    _validate(call)


def test_tool_results_flow_back_through_the_template(client, model, cluster) -> None:
    call = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
        temperature=0, parallel_tool_calls=False,
    ).choices[0].message  # fmt: skip
    history = [
        *ASK,
        call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temp_c": 18}'},
    ]
    answer = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0
    )
    assert answer.choices[0].message.content
    tokenized = httpx.post(cluster.url + "/tokenize", json={"messages": history, "tools": TOOLS})
    assert tokenized.status_code == 200, tokenized.text
    assert answer.usage.prompt_tokens == tokenized.json()["count"]
    assert (
        '{"temp_c": 18}'
        in httpx.post(
            cluster.url + "/detokenize", json={"tokens": tokenized.json()["tokens"]}
        ).json()["prompt"]
    )


PROMPT = "List the planets of the solar system: Mercury, Venus,"


@pytest.fixture(scope="module")
def offline(smollm2):
    llm = LLM(str(smollm2), num_kv_blocks=64)

    def run(**kw):
        ids = llm.tokenizer.encode(PROMPT)
        return llm.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, **kw))[0]

    return run


def test_penalties_and_logit_bias_cross_the_services(client, model, offline) -> None:
    plain = offline()
    first = plain.token_ids[0]
    cases = [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 1.8},  # over the prompt too: can change the first token
        {"logit_bias": {first: -100.0}},  # the first token (sampled on the prefill worker in PD)
    ]
    for kw in cases:
        want = offline(**kw)
        assert want.text != plain.text, kw
        body = kw | {"logit_bias": {str(t): b for t, b in kw.get("logit_bias", {}).items()}}
        out = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=body
        )
        assert out.choices[0].text == want.text, kw


def test_echo_seed_n_best_of_and_stop_ids(client, model, offline) -> None:
    plain = offline().text
    echo = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, echo=True
    )
    assert echo.choices[0].text == PROMPT + plain
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.5, "seed": 5}
    a = client.completions.create(n=2, best_of=2, **kw)
    b = client.completions.create(n=2, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text  # choice i samples with seed + i
    stop_id = offline().token_ids[2]
    cut = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert cut.choices[0].finish_reason == "stop" and plain.startswith(cut.choices[0].text)
    assert len(cut.choices[0].text) < len(plain)
    chat = client.chat.completions.create(
        model=model, messages=ASK, max_completion_tokens=3, temperature=0,
        extra_body={"min_tokens": 3, "ignore_eos": False}, user="someone",
    )  # fmt: skip
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"
