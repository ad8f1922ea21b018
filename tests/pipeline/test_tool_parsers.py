"""The tool-call finders on exact texts: hermes blocks (auto), the JSON array of `required`,
a named choice's arguments. Fed whole or split at every point, the same message comes out;
the streamed deltas join into it. The parser `auto` picks from a model's chat template."""

from __future__ import annotations

import pytest

from kvrelay.pipeline.openai.tool_calls import call_id
from kvrelay.pipeline.openai.tool_parsers import detect_tool_parser, tool_call_stream
from kvrelay.pipeline.openai.tools import ToolCalling

RID = "chatcmpl-t1"
AUTO = ToolCalling("auto")
ID0, ID1 = call_id(RID, 0), call_id(RID, 1)


def call(i: int, name: str, arguments: str) -> dict:
    return {
        "id": call_id(RID, i),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def whole(text: str, calling: ToolCalling = AUTO) -> dict:
    stream = tool_call_stream(RID, calling, "hermes")
    stream.feed(text)
    stream.finish()
    return stream.message()


def joined(deltas: list[dict]) -> dict:
    """The message a client builds from streamed deltas (as the openai client's helpers do)."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            if "id" in part:
                assert part["index"] == len(calls) and part["function"]["arguments"] == ""
                calls.append(
                    {"id": part["id"], "type": part["type"], "function": dict(part["function"])}
                )
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    message = {"role": "assistant", "content": content}
    if calls:
        message = {"role": "assistant", "content": content or None, "tool_calls": calls}
    return message


TWO_CALLS = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n'
)
CASES = [
    (
        TWO_CALLS,
        {
            "role": "assistant",
            "content": "Let me check.\n",
            "tool_calls": [
                call(0, "get_weather", '{"city": "Paris", "unit": "celsius"}'),
                call(1, "get_time", '{"zone": "CET"}'),
            ],
        },
    ),
    ("No tools needed <b> a < c", {"role": "assistant", "content": "No tools needed <b> a < c"}),
    (  # arguments first: read whole at the block's end, re-serialized
        '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
        {"role": "assistant", "content": None, "tool_calls": [call(0, "f", '{"a": 1}')]},
    ),
    (  # not a call: the block is text
        "<tool_call>not json</tool_call> after",
        {"role": "assistant", "content": "<tool_call>not json</tool_call> after"},
    ),
    (  # unclosed at the end (a length cut): the call so far; braces in strings are text
        '<tool_call>{"name": "f", "arguments": {"q": "}\\"]{", "n": [1, 2]',
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call(0, "f", '{"q": "}\\"]{", "n": [1, 2]')],
        },
    ),
    (  # text after the calls stays content; the whitespace between them does not
        '<tool_call>{"name":"f","arguments":{}}</tool_call>\n\nDone.',
        {"role": "assistant", "content": "\n\nDone.", "tool_calls": [call(0, "f", "{}")]},
    ),
    (  # a partial tag at the end is text
        "Hi <tool_ca",
        {"role": "assistant", "content": "Hi <tool_ca"},
    ),
]


@pytest.mark.parametrize(("text", "message"), CASES)
def test_hermes_message_is_exact_at_every_split(text, message):
    assert whole(text) == message
    for cut in range(len(text) + 1):
        stream = tool_call_stream(RID, AUTO, "hermes")
        deltas = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        assert stream.message() == message, cut
        assert joined(deltas) == message, cut


@pytest.mark.parametrize(("text", "message"), CASES)
def test_hermes_streamed_one_character_at_a_time(text, message):
    stream = tool_call_stream(RID, AUTO, "hermes")
    deltas = [d for c in text for d in stream.feed(c)] + stream.finish()
    assert joined(deltas) == message == stream.message()


def test_hermes_deltas_are_openais_shape():
    stream = tool_call_stream(RID, AUTO, "hermes")
    pieces = [
        "Sure",
        ". <tool",
        '_call>{"name": "get_weather", "argu',
        'ments": {"city":',
        ' "Paris"}}',
    ]
    deltas = [stream.feed(p) for p in pieces] + [stream.feed("</tool_call>"), stream.finish()]
    assert deltas == [
        [{"content": "Sure"}],
        [{"content": ". "}],  # "<tool" held back: it may be a tag
        [],  # the name is not closed yet
        [
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": ID0,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            },  # noqa: E501
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
        ],
        [{"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]}],
        [],
        [],
    ]


def test_without_parallel_calls_only_the_first_is_kept():
    message = whole(TWO_CALLS, ToolCalling("auto", parallel=False))
    assert message["tool_calls"] == [call(0, "get_weather", '{"city": "Paris", "unit": "celsius"}')]


def test_required_array_at_every_split():
    text = '[{"name": "a", "arguments": {"x": [1, {"y": "]"}]}}, {"name":"b","arguments":{}}]'
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [call(0, "a", '{"x": [1, {"y": "]"}]}'), call(1, "b", "{}")],
    }
    for cut in range(len(text) + 1):
        stream = tool_call_stream(RID, ToolCalling("required"))
        deltas = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        assert stream.message() == joined(deltas) == message, cut


def test_named_choice_is_the_arguments():
    stream = tool_call_stream(RID, ToolCalling("named", "f", parallel=False))
    assert stream.feed('{"a":') == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": ID0,
                    "type": "function",
                    "function": {"name": "f", "arguments": ""},
                }
            ]
        },  # noqa: E501
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
    ]
    assert stream.feed(" 1}") == [{"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}]
    assert stream.finish() == []
    assert stream.message() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [call(0, "f", '{"a": 1}')],
    }


def test_call_ids_depend_on_the_request_and_index_only():
    assert call_id(RID, 0) == call_id(RID, 0) != call_id(RID, 1) != call_id("other", 1)
    assert ID0.startswith("call_") and len(ID0) == 29


QWEN_LIKE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "Answer calls as <tool_call>{...}</tool_call>{% endif %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)
LLAMA_LIKE = (  # reads the tools, writes calls as bare JSON: no format this server knows
    "{% if tools %}Respond with a JSON object of the form "
    '{"name": function name, "parameters": {...}}.{% for t in tools %}{{ t | tojson }}'
    "{% endfor %}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "reads_tools", "parser"),
    [
        # SmolLM2's template ignores tools: the ingress writes them hermes-style (tool_prompt)
        ("{% for m in messages %}{{ m.content }}{% endfor %}", False, "hermes"),
        (QWEN_LIKE, True, "hermes"),
        (LLAMA_LIKE, True, None),
        (None, False, None),  # no template: no chat at all
    ],
)
def test_the_parser_detected_from_the_chat_template(template, reads_tools, parser):
    assert detect_tool_parser(template, reads_tools) == parser


def test_the_smollm2_template_gives_hermes(smollm_tokenizer):
    tok = smollm_tokenizer
    assert "<tool_call>" not in tok.chat_template and not tok.template_reads_tools
    assert detect_tool_parser(tok.chat_template, tok.template_reads_tools) == "hermes"
