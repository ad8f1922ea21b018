"""Requests the ingress refuses: OpenAI error shape, status codes, nothing queued."""

from __future__ import annotations

import pytest

from tests.pipeline.ingress_support import MODEL, http, make_config

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]
SALT = "Parameter 'cache_salt' must be a non-empty string if provided."


def err(message, param=None, code=None, type_="invalid_request_error"):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def _queued(app) -> int:
    ing = app.state.ingress
    return await ing.redis.xlen(ing.keys.prefill_stream) + await ing.redis.xlen(
        ing.keys.decode_stream
    )


CASES = [
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "n": 17},
        400,
        err("n must be at most 16, got 17", "n"),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "temperature": "hot"},
        400,
        err("'temperature' must be a number", "temperature", "invalid_type"),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "max_tokens": True},
        400,
        err("'max_tokens' must be an integer", "max_tokens", "invalid_type"),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "top_p": 0},
        400,
        err("top_p must be in (0, 1], got 0.0", "top_p"),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": []},
        400,
        err("'messages' must be a non-empty array", "messages", "invalid_type"),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]},
        400,
        err(
            "messages[0].role must be one of system, developer, user, assistant, tool",
            "messages[0].role",
        ),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "tools": [{"type": "code_interpreter"}]},
        400,
        err(
            "tool type 'code_interpreter' (only function tools) is not supported by this server",
            "tools[0].type",
            "unsupported_value",
        ),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        400,
        err(
            "'messages[0].tool_calls[0].type' is a required property",
            "messages[0].tool_calls[0].type",
            "missing_required_parameter",
        ),
    ),
    (  # no text at all: refused as OpenAI does, on any role
        "/v1/chat/completions",
        {"model": MODEL, "messages": [*HI, {"role": "assistant", "content": []}]},
        400,
        err(
            "'messages[1].content' must not be an empty array",
            "messages[1].content",
            "invalid_value",
        ),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": []}]},
        400,
        err(
            "'messages[0].content' must not be an empty array",
            "messages[0].content",
            "invalid_value",
        ),
    ),
    (  # an empty salt would share pages with unsalted requests: refused as vLLM does
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "cache_salt": ""},
        400,
        err(SALT, "cache_salt", "invalid_value"),
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "cache_salt": ""},
        400,
        err(SALT, "cache_salt", "invalid_value"),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "stream_options": {}},
        400,
        err("stream_options is only allowed when stream is true", "stream_options"),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "top_logprobs": 3},
        400,
        err("top_logprobs requires logprobs to be true", "top_logprobs"),
    ),
    (
        "/v1/chat/completions",
        {"messages": HI},
        400,
        err("you must provide a model parameter", "model", "missing_required_parameter"),
    ),
    (
        "/v1/chat/completions",
        {"model": "gpt-17", "messages": HI},
        404,
        err(
            f"The model `gpt-17` does not exist. Served models: {MODEL}.",
            "model",
            "model_not_found",
        ),
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": ["a", "b", "c"], "n": 6},
        400,
        err("the request asks for 18 choices (3 prompts x 6); at most 16 are allowed", "prompt"),
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": 5},
        400,
        err("'prompt' must be a string or an array of token ids", "prompt", "invalid_type"),
    ),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, err("the prompt is empty", "prompt")),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 99999]},
        400,
        err("token id 99999 is outside the vocabulary (size 49152)", "prompt", "invalid_token_id"),
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "prompt_logprobs": 2, "stream": True},
        400,
        err("prompt_logprobs is not available when stream is true", "prompt_logprobs"),
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 5000},
        400,
        err("max_tokens must be at most 4096, got 5000", "max_tokens"),
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 0},
        400,
        err("max_tokens must be at least 1, got 0", "max_tokens"),
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logprobs": 21},
        400,
        err("logprobs must be in [0, 20], got 21", "logprobs"),
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "expected"), CASES)
async def test_bad_requests_are_refused(harness, path, body, status, expected):
    factory, _ = harness
    app = factory()
    async with http(app) as client:
        resp = await client.post(path, json=body)
    assert (resp.status_code, resp.json()) == (status, expected)
    assert resp.headers["x-request-id"]
    assert await _queued(app) == 0


async def test_malformed_json_and_non_object_body(harness):
    factory, _ = harness
    app = factory()
    async with http(app) as client:
        resp = await client.post(
            "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}
        )
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "invalid_json"
        assert resp.json()["error"]["message"].startswith("We could not parse the JSON body")
        resp = await client.post("/v1/completions", json=[1, 2])
        assert resp.json() == err("the request body must be a JSON object", code="invalid_body")
        resp = await client.get("/v1/nothing")
        assert (resp.status_code, resp.json()) == (404, err("Not Found", code="not_found"))


async def test_a_body_declared_as_anything_but_json_is_415(harness):
    factory, _ = harness
    app = factory()
    body = b'{"model": "%s", "prompt": "Hi", "max_tokens": 0}' % MODEL.encode()
    async with http(app) as client:
        for declared in ("text/plain", "application/xml", "application/x-www-form-urlencoded"):
            resp = await client.post(
                "/v1/completions", content=body, headers={"content-type": declared}
            )
            assert (resp.status_code, resp.json()) == (
                415,
                err(
                    f"Unsupported Content-Type '{declared}': send the body as JSON, with "
                    "'Content-Type: application/json'",
                    "Content-Type",
                    "unsupported_media_type",
                ),
            ), declared
        # JSON, a +json type, or nothing declared: parsed (and refused for max_tokens: 0)
        for headers in (
            {"content-type": "application/json; charset=utf-8"},
            {"content-type": "application/vnd.api+json"},
            {},
        ):
            resp = await client.post("/v1/completions", content=body, headers=headers)
            assert (resp.status_code, resp.json()["error"]["param"]) == (400, "max_tokens")
        metrics = (await client.get("/metrics")).text
    assert 'kvrelay:requests_rejected_total{status="415"} 3.0' in metrics
    assert await _queued(app) == 0


async def test_context_overflow_states_the_completion_asked_for(valkey_session, smollm_tokenizer):
    from kvrelay.pipeline.server.app import create_app

    # the real model directory supplies the 8192-token context; the prompt alone fills it
    app = create_app(make_config(valkey_session.url, max_prompt_tokens=100000))
    prompt = {"model": MODEL, "prompt": [28] * 8192}
    long_chat = [{"role": "user", "content": "hi " * 9000}]
    try:
        async with http(app) as client:
            resp = await client.post("/v1/completions", json={**prompt, "max_tokens": 64})
            assert (resp.status_code, resp.json()) == (
                400,
                err(
                    "This model's maximum context length is 8192 tokens. However, you requested "
                    "8256 tokens (8192 in the prompt, 64 in the completion). Please reduce the "
                    "length of the prompt or completion.",
                    "prompt",
                    "context_length_exceeded",
                ),
            )
            resp = await client.post("/v1/completions", json=prompt)  # no max_tokens: vLLM's words
            assert (resp.status_code, resp.json()) == (
                400,
                err(
                    "This model's maximum context length is 8192 tokens. However, your request "
                    "has 8192 input tokens. Please reduce the length of the prompt.",
                    "prompt",
                    "context_length_exceeded",
                ),
            )
            chat = {"model": MODEL, "messages": long_chat, "max_completion_tokens": 64}
            resp = await client.post("/v1/chat/completions", json=chat)
            n = len(smollm_tokenizer.apply_chat_template(long_chat))
            assert n > 8192
            assert (resp.status_code, resp.json()) == (
                400,
                err(
                    "This model's maximum context length is 8192 tokens. However, you requested "
                    f"{n + 64} tokens ({n} in the messages, 64 in the completion). Please reduce "
                    "the length of the messages or completion.",
                    "messages",
                    "context_length_exceeded",
                ),
            )
        assert await _queued(app) == 0
    finally:
        await app.state.ingress.aclose()


async def test_body_size_limit(harness):
    factory, _ = harness
    app = factory(max_body_bytes=200)
    async with http(app) as client:
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 300})
        assert resp.status_code == 413
        assert resp.json() == err(
            "the request body is larger than 200 bytes", code="request_too_large"
        )

        async def chunks():  # no content-length: the limit holds while streaming the body
            yield b'{"model": "m", "prompt": "'
            yield b"y" * 300
            yield b'"}'

        resp = await client.post("/v1/completions", content=chunks())
        assert resp.status_code == 413
    assert await _queued(app) == 0


async def test_prompt_limits_use_the_model_context(valkey_session, smollm_tokenizer):
    from kvrelay.pipeline.server.app import create_app

    # no injected tokenizer: the real model directory supplies the 8192-token context
    app = create_app(make_config(valkey_session.url, max_prompt_tokens=100000))
    ids = [28] * 8190
    try:
        async with http(app) as client:
            resp = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 10}
            )
            assert (resp.status_code, resp.json()) == (
                400,
                err(
                    "This model's maximum context length is 8192 tokens. However, you requested "
                    "8200 tokens (8190 in the prompt, 10 in the completion). Please reduce the "
                    "length of the prompt or completion.",
                    "prompt",
                    "context_length_exceeded",
                ),
            )
            resp = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": [28] * 8192}
            )
            assert resp.json()["error"]["code"] == "context_length_exceeded"
        app2 = create_app(make_config(valkey_session.url, max_prompt_tokens=10))
        async with http(app2) as client:
            resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI})
            assert (resp.status_code, resp.json()) == (
                400,
                err(
                    "the prompt has 31 tokens, more than this server accepts (10)",
                    "messages",
                    "context_length_exceeded",
                ),
            )
        await app2.state.ingress.aclose()
    finally:
        await app.state.ingress.aclose()


async def test_backpressure_429_with_retry_after(harness):
    factory, _ = harness
    app = factory(max_waiting=2, retry_after_s=3)
    ing = app.state.ingress
    async with http(app) as client:
        # nobody consumes: two queued entries reach the bound
        await ing.redis.xadd(ing.keys.prefill_stream, {"m": b"x"})
        await ing.redis.xadd(ing.keys.decode_stream, {"m": b"x"})
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI})
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "3"
    assert resp.json() == err(
        "The server is overloaded (2 requests waiting for a worker); retry after 3 s.",
        code="overloaded",
        type_="rate_limit_error",
    )
    assert await _queued(app) == 2


async def test_redis_down_is_503(smollm_tokenizer):
    from kvrelay.pipeline.server.app import create_app
    from tests.conftest import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    # a short wait for the unreachable Redis (the default rides out 30 s of a restart)
    config = make_config(url, submit_wait_s=0.5)
    app = create_app(config, tokenizers={MODEL: smollm_tokenizer})
    try:
        async with http(app) as client:
            resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI})
            assert (resp.status_code, resp.json()) == (
                503,
                err(
                    "the request queue (Redis) is unavailable",
                    code="queue_unavailable",
                    type_="service_unavailable",
                ),
            )
            resp = await client.get("/health")
            assert resp.status_code == 503 and resp.json()["redis"] is False
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL]
    finally:
        await app.state.ingress.aclose()
