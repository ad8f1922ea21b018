"""echo and logit_bias over the ingress (real Valkey and tokenizer; a WorkerRole answers)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrelay.core.sampling import SamplingParams
from tests.pipeline.ingress_support import MODEL, http, parse_sse

pytestmark = pytest.mark.anyio

PIECES = [(19556, "Hello"), (905, " world")]
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}
HI = [{"role": "user", "content": "Hi"}]


def err(message, param=None, code=None):
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return {"error": error}


async def _post(app, role, body: dict, request_id: str):
    serve = asyncio.create_task(role.serve_one(PIECES, usage=USAGE))
    async with http(app) as client:
        resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": request_id})
    taken = await serve
    assert resp.status_code == 200, resp.text
    return resp, taken


async def test_echo_prefixes_the_prompt_whole_and_streamed(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {"model": MODEL, "prompt": "Say hi:", "max_tokens": 2, "echo": True}
    resp, _ = await _post(app, role, body, "echo-1")
    choice = resp.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("Say hi:Hello world", "stop")

    resp, _ = await _post(app, role, {**body, "stream": True}, "echo-2")
    events = parse_sse(resp.content)
    texts = [(eid, json.loads(data)["choices"][0]["text"]) for eid, data in events[:-1]]
    assert texts == [("0", "Say hi:Hello"), ("1", " world")]  # the first chunk, as vLLM
    async with http(app) as client:
        again = await client.get("/v1/requests/echo-2/stream")  # a full replay echoes too
        assert parse_sse(again.content) == events
        resumed = await client.get("/v1/requests/echo-2/stream", headers={"Last-Event-ID": "0"})
        assert parse_sse(resumed.content) == events[1:]  # after token 0: no prompt again
        # the same request posted again (non-streaming) reattaches with the same text
        whole = await client.post(
            "/v1/completions", json=body | {"stream": False}, headers={"X-Request-Id": "echo-2"}
        )
        assert whole.json()["choices"][0]["text"] == "Say hi:Hello world"


async def test_echo_of_token_ids_is_the_decoded_prompt(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    ids = [1, 9690, 198, 19556]  # <|im_start|>system\nHello
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>system\nHello"
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "echo": True}
    resp, taken = await _post(app, role, body, "echo-ids")
    assert taken.task.prompt_token_ids == ids
    assert resp.json()["choices"][0]["text"] == "<|im_start|>system\nHelloHello world"


async def test_echo_changes_the_request_digest(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {"model": MODEL, "prompt": "Say hi:", "max_tokens": 2}
    await _post(app, role, body, "echo-3")
    async with http(app) as client:
        resp = await client.post(
            "/v1/completions", json={**body, "echo": True}, headers={"X-Request-Id": "echo-3"}
        )
    assert resp.status_code == 409


async def test_logit_bias_reaches_the_task(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0}
    _, taken = await _post(app, role, {**body, "logit_bias": {"30": 100, "504": -100}}, "lb-1")
    expected = SamplingParams(
        max_tokens=2, temperature=0.0, top_p=0.9, logit_bias={30: 100.0, 504: -100.0}
    )
    assert taken.task.sampling == expected
    serve = asyncio.create_task(role.serve_one(PIECES, usage=USAGE))
    chat = {"model": MODEL, "messages": HI, "max_tokens": 2, "logit_bias": {"7": 1.5}}
    async with http(app) as client:
        resp = await client.post("/v1/chat/completions", json=chat)
    assert resp.status_code == 200
    assert (await serve).task.sampling.logit_bias == {7: 1.5}


REFUSED = [
    (
        {"logit_bias": {"49152": 1, "5": 2}},
        err(
            "token_id(s) [49152] in logit_bias contain out-of-vocab token ids. "
            "Vocabulary size: 49152",
            "logit_bias",
        ),
    ),
    (
        {"logit_bias": {"-1": 1}},
        err(
            "token_id(s) [-1] in logit_bias contain out-of-vocab token ids. Vocabulary size: 49152",
            "logit_bias",
        ),
    ),
    (
        {"logit_bias": {"5": 101}},
        err("logit_bias must map token ids to numbers in [-100, 100], got 101", "logit_bias"),
    ),
    ({"logit_bias": {"x": 1}}, err("logit_bias has an invalid token id 'x'", "logit_bias")),
    (
        {"logit_bias": {"5": "1"}},
        err(
            "'logit_bias' must be an object mapping token ids to numbers",
            "logit_bias",
            "invalid_type",
        ),
    ),
    (
        {"prompt_logprobs": 21},
        err("prompt_logprobs must be in [0, 20], got 21", "prompt_logprobs"),
    ),
    (
        {"prompt_logprobs": -1},  # vLLM's "the whole vocabulary": not served
        err("prompt_logprobs must be in [0, 20], got -1", "prompt_logprobs"),
    ),
    (
        {"prompt_logprobs": 1, "stream": True},
        err("prompt_logprobs is not available when stream is true", "prompt_logprobs"),
    ),
]


@pytest.mark.parametrize(("extra", "answer"), REFUSED)
async def test_refusals(harness, extra, answer):
    factory, _ = harness
    app = factory()
    async with http(app) as client:
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **extra})
    assert (resp.status_code, resp.json()) == (400, answer)
    ing = app.state.ingress
    queued = await ing.redis.xlen(ing.keys.prefill_stream)
    assert queued + await ing.redis.xlen(ing.keys.decode_stream) == 0


def test_producer_client_sends_int_keys():
    from kvrelay.pipeline.client.validate import parse_request, sampling_fields

    fields = sampling_fields(SamplingParams(temperature=0.0, logit_bias={5: 1, 7: -2.5}))
    assert fields == {"temperature": 0.0, "logit_bias": {5: 1, 7: -2.5}}
    parsed = parse_request({"model": MODEL, **fields}, "x", None, None)
    assert parsed.sampling.logit_bias == {5: 1.0, 7: -2.5}
