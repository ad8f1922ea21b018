"""Field validation (parsers and over HTTP): huge integers, lone surrogates, content parts,
names, tool messages."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrelay.core.messages import MessageError, PrefillTask
from kvrelay.core.sampling import InvalidSamplingParams, SamplingParams
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.openai.protocol import parse_chat, parse_completion
from tests.pipeline.ingress_support import MODEL, http

pytestmark = pytest.mark.anyio

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = '[{"role": "user", "content": "hi"}]'
RANGE = "must be an integer between -9223372036854775808 and 9223372036854775807"
SURROGATE = "is not valid Unicode: it holds a lone UTF-16 surrogate"


def chat(extra: str, messages: str = HI) -> str:
    return f'{{"model": "{MODEL}", "messages": {messages}, "max_tokens": 3{extra}}}'


def text(extra: str, prompt: str = '"hi"') -> str:
    return f'{{"model": "{MODEL}", "prompt": {prompt}, "max_tokens": 3{extra}}}'


def _schema_named(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": {}}}


# (path, raw JSON body, code, param, message); bodies are raw text so "\ud83d" stays an escape
CASES = [
    (
        CHAT,
        chat(', "max_completion_tokens": 100000'),
        None,
        "max_completion_tokens",
        "max_completion_tokens must be at most 4096, got 100000",
    ),  # fmt: skip
    (TEXT, "[" * 100_000, "invalid_json", None, None),  # nesting too deep for json.loads
    (CHAT, chat(', "seed": 18446744073709551616'), None, "seed", f"'seed' {RANGE}"),
    (CHAT, chat(', "seed": -9223372036854775809'), None, "seed", f"'seed' {RANGE}"),
    (CHAT, chat(', "top_k": 1180591620717411303424'), None, "top_k", f"'top_k' {RANGE}"),
    (TEXT, text(', "min_tokens": 18446744073709551616'), None, "min_tokens", None),
    (TEXT, text(', "stop_token_ids": [2, 18446744073709551616]'), None, "stop_token_ids[1]", None),
    (TEXT, text("", "[1, 18446744073709551616]"), None, "prompt[1]", None),
    (TEXT, text(', "temperature": 1' + "0" * 400), None, "temperature", None),
    (TEXT, text("", '"\\ud83d lone"'), "invalid_value", "prompt", f"'prompt' {SURROGATE}"),
    (
        CHAT,
        chat("", '[{"role": "user", "content": "a\\ud83d"}]'),
        "invalid_value",
        "messages[0].content",
        f"'messages[0].content' {SURROGATE}",
    ),
    (TEXT, text(', "stop": "\\udc00"'), "invalid_value", "stop", None),
    (TEXT, text(', "user": "\\ud83d"'), "invalid_value", "user", None),
    (TEXT, text(', "cache_salt": "\\ud83d"'), "invalid_value", "cache_salt", None),
    (TEXT, '{"model": "\\ud83d", "prompt": "x"}', "invalid_value", "model", None),
    (
        CHAT,
        chat("", '[{"role": "user", "content": null}]'),
        "invalid_type",
        "messages[0].content",
        "'messages[0].content' must be a string or an array of text parts, not null",
    ),
    (
        CHAT,
        chat("", '[{"role": "user", "content": [{"type": "text"}]}]'),
        "missing_required_parameter",
        "messages[0].content[0].text",
        "'messages[0].content[0].text' is a required property",
    ),
    (
        CHAT,
        chat("", '[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]'),
        "unsupported_value",
        "messages[0].content[0].type",
        "content part type 'image_url' is not supported by this server",
    ),
    (
        CHAT,
        chat(', "max_completion_tokens": 0'),
        None,
        "max_completion_tokens",
        "max_completion_tokens must be at least 1, got 0",
    ),
    # OpenAI's rule for a JSON schema's name: 1-64 of a-zA-Z0-9_-
    *[
        (
            CHAT,
            chat(', "response_format": ' + json.dumps(_schema_named(name))),
            None,
            "response_format.json_schema.name",
            "'response_format.json_schema.name' must be 1-64 characters of a-z, A-Z, 0-9, "
            "underscores and dashes",
        )
        for name in ("bad name!", "x" * 65, "")
    ],
    # a tool message answers a call of the assistant message before it (OpenAI's words)
    (
        CHAT,
        chat("", '[{"role": "user", "content": "a"}, {"role": "tool", "content": "r"}]'),
        "missing_required_parameter",
        "messages[1].tool_call_id",
        "Missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'.",
    ),
    (
        CHAT,
        chat(
            "",
            '[{"role": "user", "content": "a"}, '
            '{"role": "tool", "tool_call_id": "call_1", "content": "r"}]',
        ),
        None,
        "messages[1].role",
        "Invalid parameter: messages with role 'tool' must be a response to a preceeding "
        "message with 'tool_calls'.",
    ),
    (
        CHAT,
        chat(
            "",
            '[{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": '
            '[{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '
            '"{}"}}]}, {"role": "tool", "tool_call_id": "call_2", "content": "r"}]',
        ),
        None,
        "messages[2].tool_call_id",
        "Invalid parameter: 'tool_call_id' of 'call_2' not found in 'tool_calls' of previous "
        "message.",
    ),
]


async def _queued(app) -> int:
    ing = app.state.ingress
    return await ing.redis.xlen(ing.keys.prefill_stream) + await ing.redis.xlen(
        ing.keys.decode_stream
    )


async def test_invalid_fields_are_400_naming_the_field(harness):
    factory, _ = harness
    app = factory()
    headers = {"content-type": "application/json"}
    async with http(app) as client:
        for path, raw, code, param, message in CASES:
            resp = await client.post(path, content=raw.encode(), headers=headers)
            assert resp.status_code == 400, (raw, resp.text)
            err = resp.json()["error"]
            assert (err["type"], err["code"], err["param"]) == (
                "invalid_request_error",
                code,
                param,
            ), raw
            if message is not None:
                assert err["message"] == message
    assert await _queued(app) == 0


async def test_64_bit_seed_edges_and_assistant_null_content_are_queued(harness):
    factory, worker = harness
    app = factory(mode="disaggregated")
    role = await worker(app)
    messages = (
        '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": null},'
        ' {"role": "user", "content": [{"type": "text", "text": "\\ud83d\\ude00"}]}]'
    )
    headers = {"content-type": "application/json"}
    async with http(app) as client:
        for seed in (2**63 - 1, -(2**63)):
            serve = asyncio.create_task(role.serve_one([(19556, "Hello")]))
            raw = chat(f', "seed": {seed}, "top_k": {2**63 - 1}', messages)
            resp = await client.post(CHAT, content=raw.encode(), headers=headers)
            taken = await serve
            assert resp.status_code == 200, resp.text
            assert (taken.task.sampling.seed, taken.task.sampling.top_k) == (seed, 2**63 - 1)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ('{"model": "m", "prompt": "\\ud83d lone"}', "prompt"),
        ('{"model": "m", "prompt": ["\\udc00"]}', "prompt[0]"),
        ('{"model": "\\ud83d", "prompt": "x"}', "model"),
        ('{"model": "m", "prompt": "x", "stop": ["a", "\\ud83d"]}', "stop[1]"),
        ('{"model": "m", "prompt": "x", "user": "\\ud83d"}', "user"),
        ('{"model": "m", "prompt": "x", "cache_salt": "a\\udfff"}', "cache_salt"),
        ('{"model": "m", "prompt": "x", "extra": {"k": ["\\ud800"]}}', "extra.k[0]"),
        ('{"model": "m", "prompt": "x", "\\ud83d": 1}', None),
    ],
)
def test_lone_surrogates_are_refused(raw, param):
    with pytest.raises(RequestError) as info:
        parse_completion(json.loads(raw))
    assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_value", param)


def test_lone_surrogates_in_chat_and_valid_pairs():
    parts = [{"type": "text", "text": "ok"}, {"type": "text", "text": "\ud83d"}]
    with pytest.raises(RequestError) as info:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": parts}]})
    assert (info.value.code, info.value.param) == ("invalid_value", "messages[0].content[1].text")
    assert info.value.message == (
        "'messages[0].content[1].text' is not valid Unicode: it holds a lone UTF-16 surrogate"
    )
    pair = json.loads('{"model": "m", "prompt": "\\ud83d\\ude00"}')  # a valid pair: one emoji
    assert parse_completion(pair).prompt == "\U0001f600"
    deep = {"model": "m", "prompt": "x", "extra": [[["\ud83d"]]]}
    with pytest.raises(RequestError) as info:
        parse_completion(deep)
    assert info.value.param == "extra[0][0][0]"


def test_sampling_validate_bounds_integers():
    for name, value in (("seed", 2**64), ("top_k", 2**63), ("min_tokens", -(2**63) - 1)):
        with pytest.raises(InvalidSamplingParams) as info:
            SamplingParams(max_tokens=None, **{name: value}).validate()
        assert info.value.param == name
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(stop_token_ids=[2**64]).validate()
    assert info.value.param == "stop_token_ids"
    assert SamplingParams(seed=-(2**63), top_k=2**63 - 1).validate().seed == -(2**63)
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(stop=["ok", "\udc00"]).validate()
    assert (info.value.param, str(info.value)) == (
        "stop",
        "stop strings must be valid Unicode (no lone UTF-16 surrogates)",
    )


def test_task_encode_raises_message_error():
    with pytest.raises(MessageError) as info:
        PrefillTask(request_id="r", prompt_token_ids=[2**64], sampling={}).encode()
    assert str(info.value) == "prefill cannot be encoded: Integer value out of range"
    with pytest.raises(MessageError) as info:
        PrefillTask(request_id="r", prompt_token_ids=[1], cache_salt="\ud83d").encode()
    assert str(info.value).startswith("prefill cannot be encoded: 'utf-8' codec can't encode")
