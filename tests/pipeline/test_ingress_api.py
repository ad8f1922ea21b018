"""The ingress over ASGI with a real Valkey and tokenizer; a WorkerRole answers over the streams."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrelay.core.messages import DecodeTask, PrefillTask
from kvrelay.core.sampling import SamplingParams
from tests.pipeline.ingress_support import MODEL, TEST_TIMEOUT_S, http, parse_sse

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]
USAGE = {"prompt_tokens": 31, "completion_tokens": 2, "cached_tokens": 16}


async def test_chat_non_streaming_body_and_task(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory(mode="disaggregated")
    role = await worker(app)
    serve = asyncio.create_task(role.serve_one([(19556, "Hello"), (905, " world")], usage=USAGE))
    body = {
        "model": MODEL,
        "messages": HI,
        "max_tokens": 5,
        "temperature": 0,
        "seed": 7,
        "stop": ["\n\n"],
        "user": "u1",
        "cache_salt": "tenant-a",
    }
    async with http(app) as client:
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"X-Request-Id": "chat-1"}
        )
    taken = await serve
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "chat-1"
    data = resp.json()
    assert data == {
        "id": "chat-1",
        "object": "chat.completion",
        "created": data["created"],
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello world"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 31,
            "completion_tokens": 2,
            "total_tokens": 33,
            "prompt_tokens_details": {"cached_tokens": 16},
        },
    }
    task = taken.task
    assert isinstance(task, PrefillTask)
    assert task.request_id == "chat-1" and task.model == MODEL and task.cache_salt == "tenant-a"
    assert task.prompt_token_ids == smollm_tokenizer.apply_chat_template(HI)
    # top_p left out: the model's default (kvrelay's table for SmolLM2-Instruct)
    expected = SamplingParams(max_tokens=5, temperature=0.0, top_p=0.9, seed=7, stop=["\n\n"])
    assert task.sampling == expected
    assert task.deadline == pytest.approx(task.arrival_time + TEST_TIMEOUT_S)


async def test_chat_stream_exact_sse_bytes(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    serve = asyncio.create_task(role.serve_one([(19556, "Hello"), (905, " world")], usage=USAGE))
    body = {
        "model": MODEL,
        "messages": HI,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http(app) as client:
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"X-Request-Id": "sse-1"}
        )
    await serve
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    created = json.loads(parse_sse(resp.content)[0][1])["created"]
    head = (
        f'{{"id":"sse-1","object":"chat.completion.chunk","created":{created},'
        '"model":"smollm2-135m-instruct","choices":'
    )
    expected = (
        f'data: {head}[{{"index":0,"delta":{{"role":"assistant","content":""}},'
        '"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
        f'id: 0\ndata: {head}[{{"index":0,"delta":{{"content":"Hello"}},"logprobs":null,'
        '"finish_reason":null}],"usage":null}\n\n'
        f'id: 1\ndata: {head}[{{"index":0,"delta":{{"content":" world"}},"logprobs":null,'
        '"finish_reason":"stop"}],"usage":null}\n\n'
        f'data: {head}[],"usage":{{"prompt_tokens":31,"completion_tokens":2,'
        '"total_tokens":33,"prompt_tokens_details":{"cached_tokens":16}}}\n\n'
        "data: [DONE]\n\n"
    )
    assert resp.content.decode() == expected


async def test_completion_stream_without_usage_and_separate_final_chunk(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)

    async def answer():
        from kvrelay.core.messages import TokenChunk

        taken = await role.take()
        rid = taken.task.request_id
        await role.emit(rid, TokenChunk(index=0, token_ids=[905], text=" world"))
        await role.emit(rid, TokenChunk(index=1, finish_reason="length", usage=USAGE))
        await role.finish(taken)
        return taken

    serve = asyncio.create_task(answer())
    async with http(app) as client:
        resp = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "Hello",
                "max_tokens": 1,
                "stream": True,
            },
            headers={"X-Request-Id": "cmpl-9"},
        )
    taken = await serve
    # a 1-token prompt is short: auto mode sends it straight to decode, unprefilled
    assert isinstance(taken.task, DecodeTask) and taken.task.prefilled is False
    assert taken.task.prompt_token_ids == [19556]
    events = parse_sse(resp.content)
    created = json.loads(events[0][1])["created"]
    env = {"id": "cmpl-9", "object": "text_completion", "created": created, "model": MODEL}
    # the token-less final event has no id: (only events carrying tokens have one)
    assert [e[0] for e in events] == ["0", None, None]
    assert json.loads(events[0][1]) == {
        **env,
        "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": None}],
    }
    assert json.loads(events[1][1]) == {
        **env,
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
    }
    assert events[2][1] == "[DONE]"


async def test_logprobs_in_chat_and_completion_shapes(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    lps = [
        {"logprob": -0.5, "top": [[19556, -0.5], [905, -1.25]]},
        {"logprob": -0.25, "top": [[905, -0.25]]},
    ]
    pieces = [(19556, "Hello"), (905, " world")]
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(pieces, logprobs=lps))
        resp = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": HI, "logprobs": True, "top_logprobs": 2},
        )
        taken = await serve
        assert taken.task.sampling.logprobs == 2
        content = resp.json()["choices"][0]["logprobs"]["content"]
        assert content == [
            {
                "token": "Hello",
                "logprob": -0.5,
                "bytes": list(b"Hello"),
                "top_logprobs": [
                    {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")},
                    {"token": " world", "logprob": -1.25, "bytes": list(b" world")},
                ],
            },
            {
                "token": " world",
                "logprob": -0.25,
                "bytes": list(b" world"),
                "top_logprobs": [{"token": " world", "logprob": -0.25, "bytes": list(b" world")}],
            },
        ]
        serve = asyncio.create_task(role.serve_one(pieces, logprobs=lps))
        resp = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Say", "logprobs": 1}
        )
        taken = await serve
        assert taken.task.sampling.logprobs == 1
        assert resp.json()["choices"][0]["logprobs"] == {
            "tokens": ["Hello", " world"],
            "token_logprobs": [-0.5, -0.25],
            "top_logprobs": [{"Hello": -0.5, " world": -1.25}, {" world": -0.25}],
            "text_offset": [0, 5],
        }


async def test_worker_error_gives_500_and_stream_error_event(harness):
    from kvrelay.core.messages import TokenChunk

    factory, worker = harness
    app = factory()
    role = await worker(app)

    async def fail():
        taken = await role.take()
        await role.emit(
            taken.task.request_id,
            TokenChunk(index=0, finish_reason="error", error="poisoned entry"),
        )
        await role.finish(taken, "failed")

    async with http(app) as client:
        serve = asyncio.create_task(fail())
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        await serve
        assert resp.status_code == 500
        assert resp.json() == {
            "error": {
                "message": "poisoned entry",
                "type": "server_error",
                "param": None,
                "code": "generation_failed",
            }
        }
        serve = asyncio.create_task(fail())
        resp = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
        )
        await serve
        assert resp.content == (
            b'data: {"error":{"message":"poisoned entry","type":"server_error","param":null,'
            b'"code":"generation_failed"}}\n\ndata: [DONE]\n\n'
        )


async def test_models_health_and_metrics(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    async with http(app) as client:
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert models["object"] == "list" and models["data"][0]["owned_by"] == "kvrelay"
        resp = await client.get("/health")
        assert resp.status_code == 503
        assert resp.json()["error"] == (
            "stage prefill cannot serve: no live, non-draining decode worker; "
            "stage decode cannot serve: no live, non-draining decode worker"
        )
        assert resp.json()["unavailable_stages"] == ["prefill", "decode"]
        await role.heartbeat("d1", "decode")
        await role.heartbeat("p1", "prefill")
        resp = await client.get("/health")
        assert resp.status_code == 200
        assert resp.json() == {
            "status": "ok",
            "redis": True,
            "workers": {"decode": 1, "prefill": 1},
            "waiting": {"prefill": 0, "decode": 0},
            "stages": {
                "prefill": {"ready": True, "workers": 1, "served_by": "prefill"},
                "decode": {"ready": True, "workers": 1, "served_by": "decode"},
            },
        }
        serve = asyncio.create_task(
            role.serve_one([(19556, "Hello"), (905, " world")], usage=USAGE)
        )
        await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI})
        await serve
        for _ in range(50):  # the queue time is read from the record in the background
            text = (await client.get("/metrics")).text
            if "kvrelay:request_queue_time_seconds_count" in text:
                break
            await asyncio.sleep(0.02)
    label = f'model_name="{MODEL}"'
    assert f'kvrelay:request_success_total{{finished_reason="stop",{label}}} 1.0' in text
    assert f"kvrelay:generation_tokens_total{{{label}}} 2.0" in text
    assert f"kvrelay:prompt_tokens_total{{{label}}} 31.0" in text
    assert f"kvrelay:prefix_cache_hit_tokens_total{{{label}}} 16.0" in text
    assert f"kvrelay:time_to_first_token_seconds_count{{{label}}} 1.0" in text
    assert f"kvrelay:inter_token_latency_seconds_count{{{label}}} 1.0" in text
    assert f"kvrelay:e2e_request_latency_seconds_count{{{label}}} 1.0" in text
    assert f"kvrelay:request_queue_time_seconds_count{{{label}}} 1.0" in text
    assert f"kvrelay:num_requests_running{{{label}}} 0.0" in text
    assert f"kvrelay:num_requests_waiting{{{label}}} 0.0" in text
