"""The producer client refuses bad input exactly as the HTTP API does, and queues nothing."""

from __future__ import annotations

import json

import pytest

from kvrelay.core.keys import Keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.client.producer import AsyncClient, Client
from kvrelay.pipeline.errors import RequestError
from tests.conftest import free_port
from tests.pipeline.ingress_support import MODEL, WorkerRole, http, unique_prefix

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]
JSON = {"Content-Type": "application/json"}
SURROGATE = "'{}' is not valid Unicode: it holds a lone UTF-16 surrogate"
ROLES = "system, developer, user, assistant, tool"
ID_RULE = "request id must be 1-128 characters of letters, digits and ._:-"

# (submit kwargs, status, code, param, message)
CASES = [
    (dict(prompt="hi \ud83d"), 400, "invalid_value", "prompt", SURROGATE.format("prompt")),
    (
        dict(messages=[{"role": "user", "content": "a\ud83d"}]),
        400,
        "invalid_value",
        "messages[0].content",
        SURROGATE.format("messages[0].content"),
    ),
    (
        dict(prompt_token_ids=["a"]),
        400,
        "invalid_type",
        "prompt_token_ids",
        "'prompt_token_ids' must be an array of integers",
    ),
    (
        dict(prompt_token_ids=[1, 2**64]),
        400,
        None,
        "prompt_token_ids[1]",
        "'prompt_token_ids[1]' must be an integer between -9223372036854775808 and "
        "9223372036854775807",
    ),
    (dict(prompt=5), 400, "invalid_type", "prompt", "'prompt' must be a string"),
    (
        dict(messages="hello"),
        400,
        "invalid_type",
        "messages",
        "'messages' must be a non-empty array",
    ),
    (
        dict(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        None,
        "messages[0].role",
        f"messages[0].role must be one of {ROLES}",
    ),
    (dict(prompt_token_ids=[]), 400, "invalid_value", "prompt", "'prompt' must not be empty"),
    (dict(prompt=""), 400, None, "prompt", "the prompt is empty"),
    (
        dict(prompt="x", sampling={"max_token": 3}),
        400,
        "unknown_parameter",
        "sampling",
        "unknown sampling parameter 'max_token'",
    ),
    (
        dict(prompt="x", sampling="greedy"),
        400,
        "invalid_type",
        "sampling",
        "'sampling' must be a SamplingParams or a dict",
    ),
    (
        dict(prompt="x", sampling=SamplingParams(temperature="hot")),
        400,
        "invalid_type",
        "temperature",
        "'temperature' must be a number",
    ),
    (
        dict(prompt="x", sampling={"stop": ["a\ud83d"]}),
        400,
        "invalid_value",
        "stop[0]",
        SURROGATE.format("stop[0]"),
    ),
    (
        dict(prompt="x", sampling={"max_tokens": 0}),
        400,
        None,
        "max_tokens",
        "max_tokens must be at least 1, got 0",
    ),
    (
        dict(prompt="x", sampling={"top_p": 0.0}),
        400,
        None,
        "top_p",
        "top_p must be in (0, 1], got 0.0",
    ),
    (dict(prompt="x", model=5), 400, "invalid_type", "model", "'model' must be a string"),
    (
        dict(prompt="x", detokenize="yes"),
        400,
        "invalid_type",
        "detokenize",
        "'detokenize' must be a boolean",
    ),
    (dict(prompt="x", request_id="bad id"), 400, "invalid_request_id", "request_id", ID_RULE),
    (dict(prompt="x", request_id=""), 400, "invalid_request_id", "request_id", ID_RULE),
    (dict(prompt="x", request_id=7), 400, "invalid_request_id", "request_id", ID_RULE),
    (
        dict(prompt="x", messages=HI),
        400,
        None,
        None,
        "give exactly one of prompt, messages or prompt_token_ids",
    ),
]


@pytest.fixture
async def client(valkey_session, smollm_tokenizer):
    prefix = unique_prefix()
    made = AsyncClient(
        valkey_session.url, key_prefix=prefix, block_ms=100, tokenizers={MODEL: smollm_tokenizer}
    )
    yield made
    await made.aclose()


async def _keys_under(client: AsyncClient) -> list[bytes]:
    return await client.redis.keys(client.keys.prefix + "*")


@pytest.mark.parametrize(("kwargs", "status", "code", "param", "message"), CASES)
async def test_submit_refuses_bad_input(client, kwargs, status, code, param, message):
    with pytest.raises(RequestError) as info:
        await client.submit(**kwargs)
    err = info.value
    assert (err.status, err.code, err.param, err.message) == (status, code, param, message)
    assert await _keys_under(client) == []  # nothing queued, no record


# (HTTP body fields, the same request through submit())
SAME = [
    ({"prompt": "hi \ud83d"}, dict(prompt="hi \ud83d")),
    ({"prompt": []}, dict(prompt_token_ids=[])),
    ({"prompt": [1, 99999]}, dict(prompt_token_ids=[1, 99999])),
    (
        {"prompt": "x", "stop": ["a", "b\ud83d"]},
        dict(prompt="x", sampling={"stop": ["a", "b\ud83d"]}),
    ),
    ({"prompt": "x", "temperature": "hot"}, dict(prompt="x", sampling={"temperature": "hot"})),
    ({"prompt": "x", "max_tokens": 9000}, dict(prompt="x", sampling={"max_tokens": 9000})),
    (
        {"messages": [{"role": "wizard", "content": "hi"}]},
        dict(messages=[{"role": "wizard", "content": "hi"}]),
    ),
    ({"messages": [{"role": "user"}]}, dict(messages=[{"role": "user"}])),
    ({"messages": "hello"}, dict(messages="hello")),
    ({"prompt": "x", "model": "gpt-17"}, dict(prompt="x", model="gpt-17")),
]


async def test_client_errors_match_http(harness, smollm_tokenizer):
    factory, _worker = harness
    app = factory()
    ing = app.state.ingress
    path = {"prompt": "/v1/completions", "messages": "/v1/chat/completions"}
    async with (
        http(app) as api,
        AsyncClient(
            ing.config.redis_url,
            key_prefix=ing.config.key_prefix,
            tokenizers={MODEL: smollm_tokenizer},
        ) as client,
    ):
        for fields, kwargs in SAME:
            kind = "messages" if "messages" in fields else "prompt"
            # json.dumps escapes a lone surrogate as \\ud83d, as an HTTP client sends it
            body = json.dumps({"model": MODEL, **fields})
            resp = await api.post(path[kind], content=body, headers=JSON)
            with pytest.raises(RequestError) as info:
                await client.submit(**kwargs)
            assert (info.value.status, info.value.body()) == (resp.status_code, resp.json())
        assert await _keys_under(client) == []


async def test_sampling_dict_is_accepted(valkey_session, smollm_tokenizer):
    prefix = unique_prefix()
    role = await WorkerRole(valkey_session.url, Keys(prefix)).setup()
    client = AsyncClient(
        valkey_session.url, key_prefix=prefix, tokenizers={MODEL: smollm_tokenizer}
    )
    try:
        rid = await client.submit("Hello", sampling={"max_tokens": 3, "temperature": 0})
        task = (await role.take()).task
        # top_p left out: the model's default (kvrelay's table for SmolLM2-Instruct)
        expected = SamplingParams(max_tokens=3, temperature=0.0, top_p=0.9)
        assert (task.request_id, task.sampling) == (rid, expected)
        rid = await client.submit(prompt_token_ids=(5, 6), sampling={"max_tokens": 1})
        task = (await role.take()).task
        assert (task.request_id, task.prompt_token_ids) == (rid, [5, 6])
        rid = await client.submit(messages=HI, sampling={"logprobs": 2, "max_tokens": 1})
        task = (await role.take()).task
        assert (task.request_id, task.sampling.logprobs) == (rid, 2)
    finally:
        await client.aclose()
        await role.aclose()


async def test_redis_down_is_a_503(smollm_tokenizer):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    # submit_wait_s=0: no waiting for Redis to come back (test_submit_outage.py waits)
    async with AsyncClient(url, tokenizers={MODEL: smollm_tokenizer}, submit_wait_s=0) as client:
        calls = [
            client.submit("hi"),
            client.result("r-1"),
            client.status("r-1"),
            client.cancel("r-1"),
        ]
        for call in calls:
            with pytest.raises(RequestError) as info:
                await call
            err = info.value
            assert (err.status, err.type, err.code, err.message) == (
                503,
                "service_unavailable",
                "queue_unavailable",
                "the request queue (Redis) is unavailable",
            )


@pytest.mark.parametrize("start", [-3, "2", True, 1.5])
async def test_result_refuses_a_bad_start_index(client, start):
    with pytest.raises(RequestError) as info:
        await client.result("r-1", start_index=start)
    err = info.value
    assert (err.status, err.code, err.param, err.message) == (
        400,
        "invalid_value",
        "start_index",
        f"start_index must be a non-negative integer, got {start!r}",
    )


async def test_read_calls_check_the_request_id(client):
    for call in (client.result("a b"), client.status("a/b"), client.cancel(""), client.status(3)):
        with pytest.raises(RequestError) as info:
            await call
        assert (info.value.code, info.value.param) == ("invalid_request_id", "request_id")
    assert await _keys_under(client) == []


def test_sync_client_raises_the_same(valkey_session, smollm_tokenizer):
    with Client(
        valkey_session.url, key_prefix=unique_prefix(), tokenizers={MODEL: smollm_tokenizer}
    ) as client:
        with pytest.raises(RequestError) as info:
            client.submit(messages=[{"role": "wizard", "content": "hi"}])
        assert (info.value.status, info.value.param) == (400, "messages[0].role")
        with pytest.raises(RequestError) as info:
            client.result("r-1", start_index=-3)
        assert (info.value.status, info.value.param) == (400, "start_index")
