"""Parsing OpenAI request bodies into GenerationRequest (no server needed)."""

from __future__ import annotations

import pytest

from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.messages import TokenChunk
from kvrelay.pipeline.openai_protocol import parse_chat, parse_completion
from kvrelay.pipeline.openai_responses import ResponseFormatter, sse, usage_dict
from kvrelay.pipeline.output import Completion, trim_chunk
from kvrelay.pipeline.sampling import SamplingParams


def test_chat_fields_map_to_sampling():
    req = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": None},
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
            "unknown_extra": {"x": 1},
        }
    )
    assert req.messages == [
        {"role": "system", "content": ""},
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


def test_completion_prompt_forms():
    assert parse_completion({"model": "m", "prompt": "hi"}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": [1, 2]}).prompt_token_ids == [1, 2]
    assert parse_completion({"model": "m", "prompt": [[1, 2]]}).prompt_token_ids == [1, 2]
    req = parse_completion({"model": "m", "prompt": "x", "logprobs": 0, "max_tokens": None})
    assert (req.logprobs, req.sampling.logprobs, req.sampling.max_tokens) == (True, 0, None)
    assert parse_completion({"model": "m", "prompt": "x"}).sampling.logprobs is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "x", "seed": 1.5}, "seed"),
        ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
        ({"model": "m", "prompt": [1, True]}, "prompt"),
        ({"model": 3, "prompt": "x"}, "model"),
    ],
)
def test_completion_type_errors(body, param):
    with pytest.raises(RequestError) as info:
        parse_completion(body)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content",
        ),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (["hello"], "messages[0]"),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}],
            "messages[0].tool_calls",
        ),
    ],
)
def test_chat_message_errors(messages, param):
    with pytest.raises(RequestError) as info:
        parse_chat({"model": "m", "messages": messages})
    assert info.value.param == param


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
    ev = fmt.chunk_event(TokenChunk(index=2, finish_reason="stop"))
    assert ev == (
        b'id: 2\ndata: {"id":"r","object":"chat.completion.chunk","created":100,'
        b'"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,'
        b'"finish_reason":"stop"}]}\n\n'
    )
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
