"""Tools in the prompt for chat templates that do not render them: a hermes-style prompt.

A template that reads `tools` (Qwen2.5, Hermes, Llama 3.1, ...) gets the tools and the
messages as transformers passes them. One that does not (SmolLM2's) would drop them silently,
so the conversation is rewritten first, as Qwen2.5's template writes it: the tools are
described in the system message, an assistant's calls become `<tool_call>` blocks in its text
and tool results become user turns of `<tool_response>` blocks. The model then answers in the
hermes format the `hermes` tool parser reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that describes `tools` (OpenAI's tool objects)."""
    return _HEAD + "".join("\n" + _dumps(tool) for tool in tools) + _TAIL


def _call_block(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments")}
    return "<tool_call>\n" + _dumps(body) + "\n</tool_call>"


def hermes_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` with the tools, calls and results written as text (see the module doc);
    tool-call `arguments` are objects here, as chat templates receive them."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(call) for call in message["tool_calls"]]
            text = "\n".join(([content] if content else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            text = "<tool_response>\n" + content + "\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls",)})
    for message in out:
        message.pop("tool_results", None)
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0].get("role") in ("system", "developer"):
            first = out[0]
            text = first.get("content") or ""
            out[0] = {**first, "content": (text + "\n\n" if text else "") + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
