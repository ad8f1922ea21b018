"""Parsing OpenAI request bodies into GenerationRequest (no server needed)."""

from __future__ import annotations

import pytest

from kvrelay.core.messages import TokenChunk
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.openai.completion_format import ResponseFormatter, sse, usage_dict
from kvrelay.pipeline.openai.protocol import parse_chat, parse_completion
from kvrelay.pipeline.queue.output import Completion, trim_chunk


def test_chat_fields_map_to_sampling():
    req = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "assistant", "content": None},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "name": "ann",
                },
            ],
            "max_tokens": 3,
            "max_completion_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 11,
            "stop": "END",
            "presence_penalty": 0.1,
            "frequency_penalty": -0.2,
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop_token_ids": [7],
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 4,
            "user": "u",
            "cache_salt": "t",
            "stream": True,
            "stream_options": {"include_usage": True},
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "metadata": {"x": "1"},  # a pass-through field (unknown ones are refused)
        }
    )
    assert req.messages == [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "ab", "name": "ann"},
    ]
    assert req.sampling == SamplingParams(
        max_tokens=9,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.1,
        frequency_penalty=-0.2,
        stop=["END"],
        stop_token_ids=[7],
        ignore_eos=True,
        min_tokens=2,
        seed=11,
        logprobs=4,
    )
    assert (req.stream, req.include_usage, req.logprobs, req.user, req.cache_salt) == (
        True,
        True,
        True,
        "u",
        "t",
    )
    assert req.max_tokens_param == "max_completion_tokens"


def test_completion_prompt_forms():
    assert parse_completion({"model": "m", "prompt": "hi"}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": [1, 2]}).prompt_token_ids == [1, 2]
    assert parse_completion({"model": "m", "prompt": [[1, 2]]}).prompt_token_ids == [1, 2]
    req = parse_completion({"model": "m", "prompt": "x", "logprobs": 0, "max_tokens": None})
    assert (req.logprobs, req.sampling.logprobs, req.sampling.max_tokens) == (True, 0, None)
    assert parse_completion({"model": "m", "prompt": "x"}).sampling.logprobs is None


@pytest.mark.parametrize("prompt", [[], [[]]])
def test_empty_prompt_array_says_empty(prompt):
    with pytest.raises(RequestError) as info:
        parse_completion({"model": "m", "prompt": prompt})
    err = info.value
    assert (err.status, err.code, err.param, err.message) == (
        400,
        "invalid_value",
        "prompt",
        "'prompt' must not be empty",
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "x", "seed": 1.5}, "seed"),
        ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"model": "m", "prompt": "x", "best_of": "2"}, "best_of"),
        ({"model": "m", "prompt": "x", "n": 2, "best_of": 1}, "best_of"),
        ({"model": "m", "prompt": ["x", [1, True]]}, "prompt[1]"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": "5"}}, "logit_bias"),
        ({"model": "m", "prompt": [1, True]}, "prompt"),
        ({"model": 3, "prompt": "x"}, "model"),
    ],
)
def test_completion_type_errors(body, param):
    with pytest.raises(RequestError) as info:
        parse_completion(body)
    assert (info.value.status, info.value.param) == (400, param)


_CALLED = [
    {"role": "user", "content": "a"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    },
]
_RESULT = {"role": "tool", "content": "r", "tool_call_id": "c1"}


def test_tool_results_answer_the_calls_before_them():
    both = {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}
    called = [_CALLED[0], {**_CALLED[1], "tool_calls": [*_CALLED[1]["tool_calls"], both]}]
    results = [_RESULT, {**_RESULT, "tool_call_id": "c2"}]
    req = parse_chat({"model": "m", "messages": [*called, *results]})
    assert [m.get("tool_call_id") for m in req.messages] == [None, None, "c1", "c2"]


@pytest.mark.parametrize(
    ("messages", "code", "param"),
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "unsupported_value",
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": 5}], "invalid_type", "messages[0].content"),
        (["hello"], "invalid_type", "messages[0]"),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}],
            "missing_required_parameter",
            "messages[0].tool_calls[0].type",
        ),
        ([{"role": "user", "content": None}], "invalid_type", "messages[0].content"),
        ([{"role": "system", "content": None}], "invalid_type", "messages[0].content"),
        (
            [{"role": "tool", "tool_call_id": "c1", "content": None}],
            "invalid_type",
            "messages[0].content",
        ),
        ([{"role": "user"}], "missing_required_parameter", "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            "missing_required_parameter",
            "messages[0].content[0].text",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": [{"text": "x"}]}],
            "missing_required_parameter",
            "messages[1].content[0].type",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            "invalid_type",
            "messages[0].content[0].text",
        ),
        ([{"role": "user", "content": ["a"]}], "invalid_type", "messages[0].content[0]"),
        ([{"role": "user", "content": "a", "name": 7}], "invalid_type", "messages[0].name"),
        # a tool message answers a call of the assistant message before it, by its id
        (
            [{"role": "user", "content": "a"}, {"role": "tool", "content": "r"}],
            "missing_required_parameter",
            "messages[1].tool_call_id",
        ),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "tool", "content": "r", "tool_call_id": "c"},
            ],
            None,
            "messages[1].role",
        ),
        (
            [*_CALLED, {"role": "tool", "content": "r", "tool_call_id": "c2"}],
            None,
            "messages[2].tool_call_id",
        ),
        (
            [*_CALLED, _RESULT, {"role": "user", "content": "b"}, _RESULT],
            None,
            "messages[4].role",
        ),
    ],
)
def test_chat_message_errors(messages, code, param):
    with pytest.raises(RequestError) as info:
        parse_chat({"model": "m", "messages": messages})
    assert (info.value.status, info.value.code, info.value.param) == (400, code, param)


def test_content_part_messages():
    with pytest.raises(RequestError) as info:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert info.value.message == "'messages[0].content[0].text' is a required property"
    with pytest.raises(RequestError) as info:
        parse_chat(
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}
        )
    assert info.value.message == "content part type 'input_audio' is not supported by this server"


INT64_RANGE = "must be an integer between -9223372036854775808 and 9223372036854775807"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"top_k": 2**70}, "top_k"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"max_completion_tokens": -(2**64)}, "max_completion_tokens"),
        ({"min_tokens": 2**64}, "min_tokens"),
        ({"top_logprobs": 2**64, "logprobs": True}, "top_logprobs"),
        ({"n": 2**64}, "n"),
        ({"stop_token_ids": [1, 2**64]}, "stop_token_ids[1]"),
    ],
)
def test_chat_integers_must_fit_64_bits(extra, param):
    with pytest.raises(RequestError) as info:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    err = info.value
    assert (err.status, err.code, err.param, err.message) == (
        400,
        None,
        param,
        f"'{param}' {INT64_RANGE}",
    )


def test_integer_edges_and_huge_numbers():
    base = {"model": "m", "prompt": "x"}
    assert parse_completion({**base, "seed": 2**63 - 1}).sampling.seed == 2**63 - 1
    assert parse_completion({**base, "seed": -(2**63)}).sampling.seed == -(2**63)
    for extra, param in (
        ({"prompt": [5, 2**64]}, "prompt[1]"),
        ({"prompt": [[-(2**64)]]}, "prompt[0][0]"),
        ({"logprobs": 2**64}, "logprobs"),
        ({"best_of": 2**64}, "best_of"),
    ):
        with pytest.raises(RequestError) as info:
            parse_completion({**base, **extra})
        assert (info.value.status, info.value.param) == (400, param)
    with pytest.raises(RequestError) as info:  # float() of this integer would overflow
        parse_completion({**base, "temperature": 10**400})
    assert (info.value.param, info.value.message) == (
        "temperature",
        "'temperature' is out of range",
    )


def test_max_tokens_errors_name_the_field_sent():
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for extra, param in (
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": -1}, "max_completion_tokens"),
    ):
        with pytest.raises(RequestError) as info:
            parse_chat({**chat, **extra})
        assert (info.value.status, info.value.code, info.value.param) == (400, None, param)
        assert info.value.message == f"{param} must be at least 1, got {extra[param]}"
    req = parse_chat({**chat, "max_tokens": 3})
    assert (req.sampling.max_tokens, req.max_tokens_param) == (3, "max_tokens")
    with pytest.raises(RequestError) as info:  # chat only: unknown to /v1/completions
        parse_completion({"model": "m", "prompt": "x", "max_completion_tokens": 0})
    assert (info.value.code, info.value.param) == ("unknown_parameter", "max_completion_tokens")


def test_sse_framing_and_usage():
    assert sse({"a": "é"}, 3) == 'id: 3\ndata: {"a":"é"}\n\n'.encode()
    assert sse([1]) == b"data: [1]\n\n"
    assert usage_dict(None, 5, 2) == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_formatter_chat_events():
    fmt = ResponseFormatter("chat", "r", "m", 100, 4)
    assert fmt.chunk_event(TokenChunk(index=0)) is None  # nothing new, not final
    assert fmt.chunk_event(TokenChunk(index=0, finish_reason="error", error="x")) is None
    ev = fmt.chunk_event(TokenChunk(index=2, finish_reason="stop"))  # token-less: no id line
    assert ev == (
        b'data: {"id":"r","object":"chat.completion.chunk","created":100,'
        b'"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,'
        b'"finish_reason":"stop"}]}\n\n'
    )
    ev = fmt.chunk_event(TokenChunk(index=2, token_ids=[7], text="a"))
    assert ev.startswith(b'id: 2\ndata: {"id":"r"')
    done = Completion("r", token_ids=[1, 2], text="hi", finish_reason="length")
    assert fmt.response(done)["usage"]["total_tokens"] == 6


def test_trim_chunk():
    chunk = TokenChunk(
        index=4,
        token_ids=[1, 2, 3],
        text="abc",
        logprobs=[{"logprob": -1.0}, {"logprob": -2.0}, {"logprob": -3.0}],
    )
    assert trim_chunk(chunk, 2, None) is chunk
    cut = trim_chunk(chunk, 6, lambda ids: f"<{ids}>")
    assert (cut.index, cut.token_ids, cut.text, cut.logprobs) == (
        6,
        [3],
        "<[3]>",
        [{"logprob": -3.0}],
    )
    gone = trim_chunk(TokenChunk(index=4, token_ids=[1], finish_reason="stop"), 9, None)
    assert (gone.index, gone.token_ids, gone.finish_reason) == (4, [], "stop")
