"""Tools and tool turns into the chat template's messages.

A template that renders tools itself (it mentions `tools`, as Qwen2.5's and Hermes-2-Pro's
do) is given them as transformers' `apply_chat_template(tools=...)` gives them: the tool
list, and assistant `tool_calls` with their arguments as objects. A plain ChatML template
(SmolLM2's, the presets') knows only role and content, so the Hermes format is written into
the messages here, as Hermes-2-Pro's own template would render them:

    system      the system prompt (if any), then the tool signatures in <tools></tools> and
                how to call them
    assistant   its content, then one <tool_call> block per call
    tool        <tool_response> ... </tool_response>
"""

from __future__ import annotations

import json
from typing import Any

from rtp_serve.services.frontend.tool_calls import render_call

Message = dict[str, Any]

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def inline_tools(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message]:
    """`messages` (as `template_messages` gives them) in role/content form only."""
    out: list[Message] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                render_call(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            content = "\n".join(([content] if content else []) + calls)
        elif m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools:
        block = TOOLS_PROMPT.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
