"""POST /tokenize and /detokenize on the ingress (real Valkey and SmolLM2 tokenizer)."""

from __future__ import annotations

import pytest

from tests.pipeline.ingress_support import MODEL, http

pytestmark = pytest.mark.anyio

TEXT = "Hello world, héllo!"
IDS = [19556, 905, 28, 294, 2756, 31394, 17]  # TEXT in the SmolLM2 tokenizer
MESSAGES = [{"role": "user", "content": "Hi"}]


def err(message, param=None, code=None, type_="invalid_request_error"):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def test_tokenize_text_and_round_trip(harness, smollm_tokenizer):
    factory, worker = harness
    assert smollm_tokenizer.encode(TEXT, add_special_tokens=True) == IDS
    app = factory()
    await (await worker(app)).publish_model()  # max_model_len 8192, as a worker publishes it
    async with http(app) as client:
        resp = await client.post("/tokenize", json={"model": MODEL, "prompt": TEXT})
        assert resp.status_code == 200
        assert resp.json() == {
            "count": len(IDS),
            "max_model_len": 8192,
            "tokens": IDS,
            "token_strs": None,
        }
        resp = await client.post(
            "/tokenize", json={"prompt": TEXT, "return_token_strs": True}
        )  # no model: the first served one
        assert resp.json()["token_strs"] == ["Hello", "Ġworld", ",", "Ġh", "Ã©", "llo", "!"]
        resp = await client.post("/detokenize", json={"model": MODEL, "tokens": IDS})
        assert (resp.status_code, resp.json()) == (200, {"prompt": TEXT})
        resp = await client.post("/detokenize", json={"model": MODEL, "tokens": []})
        assert resp.json() == {"prompt": ""}


async def test_tokenize_messages_as_chat_completions_do(harness, smollm_tokenizer):
    factory, _ = harness
    expected = smollm_tokenizer.apply_chat_template(MESSAGES)
    without = smollm_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert len(expected) == 31 and expected[: len(without)] == without
    async with http(factory()) as client:
        resp = await client.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
        assert resp.json()["tokens"] == expected and resp.json()["count"] == 31
        body = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": False}
        resp = await client.post("/tokenize", json=body)
        assert resp.json()["tokens"] == without
        # special tokens are kept by /detokenize, as vLLM decodes them
        resp = await client.post("/detokenize", json={"model": MODEL, "tokens": expected})
        assert resp.json()["prompt"] == smollm_tokenizer.render_chat(MESSAGES)


REFUSED = [
    (
        "/tokenize",
        {"model": "nope", "prompt": "x"},
        404,
        err(
            "The model `nope` does not exist. Served models: smollm2-135m-instruct.",
            "model",
            "model_not_found",
        ),
    ),
    (
        "/tokenize",
        {"model": MODEL},
        400,
        err("'prompt' is a required property", "prompt", "missing_required_parameter"),
    ),
    (
        "/tokenize",
        {"model": MODEL, "prompt": 5},
        400,
        err("'prompt' must be a string", "prompt", "invalid_type"),
    ),
    (
        "/tokenize",
        {"model": MODEL, "prompt": "x", "add_generation_prompt": True},  # chat only
        400,
        err(
            "Unrecognized request argument supplied: add_generation_prompt (this server does "
            "not implement it)",
            "add_generation_prompt",
            "unknown_parameter",
        ),
    ),
    (
        "/tokenize",
        {"model": MODEL, "messages": []},
        400,
        err("'messages' must be a non-empty array", "messages", "invalid_type"),
    ),
    (
        "/detokenize",
        {"model": MODEL, "tokens": [1, 49152]},
        400,
        err("token id 49152 is outside the vocabulary (size 49152)", "tokens", "invalid_token_id"),
    ),
    (
        "/detokenize",
        {"model": MODEL, "tokens": "1 2"},
        400,
        err("'tokens' must be an array of integers", "tokens", "invalid_type"),
    ),
    (
        "/detokenize",
        [1, 2],
        400,
        err("the request body must be a JSON object", None, "invalid_body"),
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "answer"), REFUSED)
async def test_bad_inputs(harness, path, body, status, answer):
    factory, _ = harness
    async with http(factory()) as client:
        resp = await client.post(path, json=body)
    assert (resp.status_code, resp.json()) == (status, answer)


async def test_api_key_is_required(harness):
    factory, _ = harness
    async with http(factory(api_keys=("k1",))) as client:
        resp = await client.post("/tokenize", json={"prompt": "x"})
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "missing_api_key"
        resp = await client.post(
            "/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer k1"}
        )
        assert (resp.status_code, resp.json()) == (200, {"prompt": "<|im_start|>"})
