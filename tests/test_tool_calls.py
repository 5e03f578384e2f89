"""Tool calls without a model: the Hermes parser on fixed texts (whole, and streamed in
every split, accumulated by the official `openai` client's own stream state), the grammar
that enforces `required` / a named function, the chat template rendering (against HF
transformers' `apply_chat_template`), and the request fields."""

from __future__ import annotations

import json
import random

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from rtp_serve.core.structured import Grammars, StructuredOutputs
from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.services.frontend.errors import FrontendError
from rtp_serve.services.frontend.generation import Delta
from rtp_serve.services.frontend.openai_responses import Choice, ResponseBuilder
from rtp_serve.services.frontend.openai_schema import ChatCompletionRequest, parse
from rtp_serve.services.frontend.tool_calls import ToolCallParser, grammar, parse_all
from rtp_serve.services.frontend.tool_prompt import inline_tools

NAMES = frozenset({"get_weather", "get_time"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n</tool_call>'
ARGS = '{"city": "Paris", "n": [1, {"a": "}"}]}'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text, no calls.", "Just text, no calls.", []),
        ("  spaced \n", "  spaced \n", []),
        (CALL, None, [("get_weather", ARGS)]),
        ("\n" + CALL + "\n", None, [("get_weather", ARGS)]),
        ("Let me check.\n\n" + CALL, "Let me check.", [("get_weather", ARGS)]),
        (
            CALL + "\n" + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            None,
            [("get_weather", ARGS), ("get_time", "{}")],
        ),
        # SmolLM2's own format: a list in one block; arguments normalised from the objects
        (
            '<tool_call>[{"name": "get_time", "arguments": {"tz":"UTC"}}, '
            '{"name": "get_weather", "arguments": {}}]</tool_call>',
            None,
            [("get_time", '{"tz": "UTC"}'), ("get_weather", "{}")],
        ),
        # arguments as a JSON string, "parameters" for "arguments", no closing tag at the end
        (
            '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
            None,
            [("get_time", '{"tz": "UTC"}')],
        ),
        ('<tool_call>{"name": "get_time", "parameters": {}}', None, [("get_time", "{}")]),
    ],
)
def test_parser_on_fixed_texts(text, content, calls) -> None:
    got_content, got_calls = parse_all(NAMES, text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        assert c.id.startswith("call_") and len(c.id) > 10
        json.loads(c.arguments)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
        '<tool_call>[{"name": "get_time", "arguments": {}}, '
        '{"name": "get_weather", "arguments": {}}]</tool_call>',
    ],
)
def test_without_parallel_tool_calls_only_the_first_call_counts(text) -> None:
    # auto with parallel_tool_calls false: no grammar stops a second call; it is dropped.
    for pieces in ([text], list(text)):  # whole, and a character at a time
        parser = ToolCallParser(NAMES, max_calls=1)
        content = "".join(parser.push(piece)[0] for piece in pieces) + parser.finish()[0]
        assert content == "" and [c.name for c in parser.calls] == ["get_time"]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not a tool
        '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # not an object
        '<tool_call>\n["get_weather"]\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut off
        "a <tool_ call> and <tool_call",
    ],
)
def test_malformed_calls_stay_plain_content(text) -> None:
    assert parse_all(NAMES, text) == (text, [])


def test_malformed_block_between_calls_is_content_without_the_spacing() -> None:
    bad = '<tool_call>{"name": "get_weather"</tool_call>'
    content, calls = parse_all(NAMES, f"{CALL}\n{bad}\n{CALL}")
    assert content == bad and [c.name for c in calls] == ["get_weather"] * 2


def _stream(text: str, pieces: list[str], stream_arguments: bool):
    """Push `pieces` through a Choice and the response builder; the chunks, as the openai
    client reads them, accumulated by its own ChatCompletionStreamState."""
    assert "".join(pieces) == text
    builder = ResponseBuilder(True, "m", None, False)
    choice = Choice(parser=ToolCallParser(NAMES, stream_arguments))
    state = ChatCompletionStreamState()
    chunks = [builder.chunk(0, None, False, role=True, tools=True)]
    for i, piece in enumerate(pieces):
        finish = "stop" if i == len(pieces) - 1 else None
        delta, calls = choice.add(Delta(piece, [], [], finish, 1, i + 1, 0))
        chunks.append(builder.chunk(0, delta, False, tool_calls=calls))
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion().choices[0], chunks, builder.response([choice])


def _splits(text: str, rng: random.Random) -> list[list[str]]:
    cuts = [[text], list(text)]
    for _ in range(4):
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6)))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    return cuts


@pytest.mark.parametrize("stream_arguments", [False, True])
@pytest.mark.parametrize(
    "text",
    [
        "Plain words <tool but no call.",
        "Sure.\n"
        + CALL
        + "\n"
        + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut off
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> then text',
    ],
)
def test_streamed_deltas_accumulate_to_the_whole_response(text, stream_arguments) -> None:
    rng = random.Random(len(text))
    whole = None
    for pieces in _splits(text, rng):
        streamed, chunks, response = _stream(text, pieces, stream_arguments)
        message = response["choices"][0]["message"]
        assert response["choices"][0]["finish_reason"] == streamed.finish_reason
        assert streamed.message.content == message["content"]
        got = [
            (c.id, c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []
        ]
        want = [
            (c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])
        ]
        assert got == want
        shape = (message["content"], [w[1:] for w in want], streamed.finish_reason)
        whole = whole or shape
        assert shape == whole  # however the text was split
        if stream_arguments and len(pieces) == len(text) and want:
            fragments = [
                d
                for c in chunks
                for d in c["choices"][0]["delta"].get("tool_calls", [])
                if "id" not in d
            ]
            assert len(fragments) > 5  # arguments stream as they are generated
    assert whole[2] == ("tool_calls" if whole[1] else "stop")


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_grammars(model_dir) -> Grammars:
    path = model_dir("tiny-llama")
    tok = Tokenizer(path)
    return Grammars(path / "tokenizer.json", tok.vocab_size, (0,)), tok


@pytest.mark.parametrize(
    ("parallel", "text", "ok"),
    [
        (
            False,
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
            True,
        ),
        (True, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n' * 2, True),
        (False, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n' * 2, False),
        (
            False,
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            False,
        ),
        (False, '<tool_call>\n{"name": "get_wetter", "arguments": {}}\n</tool_call>', False),
        (False, 'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', False),
    ],
)
def test_tool_grammar_admits_exactly_the_calls(tiny_grammars, parallel, text, ok) -> None:
    grammars, tok = tiny_grammars
    spec = StructuredOutputs.grammar(
        grammar([("get_weather", WEATHER), ("get_time", {"type": "object"})], parallel)
    )
    spec.validate()
    guide = grammars.guide(spec)
    ids = tok.encode(text.rstrip("\n"), add_special_tokens=False)
    accepted = all(guide.accept(t) for t in ids) and guide.matcher.is_accepting()
    assert accepted == ok


TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    }
]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
]

# A Hermes-2-Pro / Qwen2.5-style template that renders tools itself.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if not (tools and m.role == 'system') %}"
    "<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_template_with_tools_renders_as_transformers(model_dir, tmp_path) -> None:
    """A template that renders tools gets them as transformers passes them; a plain ChatML
    one gets the Hermes system prompt, calls and tool responses in its messages."""
    from transformers import AutoTokenizer

    src = model_dir("tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    req = parse(ChatCompletionRequest, {"model": "m", "messages": HISTORY, "tools": TOOLS})
    ours = Tokenizer(tmp_path)
    assert ours.renders_tools
    hf = AutoTokenizer.from_pretrained(tmp_path)
    want = hf.apply_chat_template(
        req.message_dicts(), tools=req.tool_dicts(), tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(req.message_dicts(), tools=req.tool_dicts()) == want
    assert '"name": "get_weather"' in want and "<tools>" in want

    plain = Tokenizer(src)
    assert not plain.renders_tools
    text = plain.apply_chat_template(inline_tools(req.message_dicts(), req.tool_dicts()))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(req.tool_dicts()[0]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Oslo", "unit": "celsius"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>tool\n<tool_response>\n{"temp": 3}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    ) in text


def _chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | kw


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(tools=[{"type": "function"}]), "tools[0].function"),
        (_chat(tools=[{"type": "code", "function": {"name": "f"}}]), "tools[0].type"),
        (
            _chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
            "tools[0].function.name",
        ),
        (_chat(tools=TOOLS * 2), "tools"),
        (
            _chat(
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
                ]
            ),
            "tools[0].function.parameters",
        ),
        (_chat(tool_choice="required"), "tool_choice"),
        (_chat(tools=TOOLS, tool_choice="always"), "tool_choice"),
        (
            _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "other"}}),
            "tool_choice",
        ),
        (
            _chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
            "response_format",
        ),
        (
            _chat(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{x"},
                            }
                        ],
                    }
                ]
            ),
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_fields_are_a_400_naming_the_field(body, param) -> None:
    with pytest.raises(FrontendError) as err:
        parse(ChatCompletionRequest, body)
    assert err.value.param == param, err.value.message


def test_tool_fields_parse() -> None:
    req = parse(ChatCompletionRequest, _chat(tools=TOOLS))
    assert req.tool_mode == "auto" and req.options.structured is None
    assert req.tool_parser() is not None and not req.tool_parser().stream_arguments
    req = parse(ChatCompletionRequest, _chat(tools=TOOLS, tool_choice="none"))
    assert req.tool_parser() is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    req = parse(
        ChatCompletionRequest, _chat(tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    )
    assert req.tool_mode == "named" and req.tool_parser().stream_arguments
    assert "get_weather" in req.options.structured.spec
    assert parse(ChatCompletionRequest, _chat()).tool_parser() is None
