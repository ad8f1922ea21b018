"""Request state, cancel, resumed streams (Last-Event-ID) and idempotent request ids."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.queue.progress import Progress
from tests.pipeline.ingress_support import MODEL, http, parse_sse

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]
PIECES = [(19556, "Hello"), (905, " world"), (17, "!")]
USAGE = {"prompt_tokens": 31, "completion_tokens": 3, "cached_tokens": 0}


async def _finished_request(app, role, request_id: str, stream: bool = True) -> bytes:
    serve = asyncio.create_task(role.serve_one(PIECES, usage=USAGE))
    async with http(app) as client:
        resp = await client.post(
            "/v1/chat/completions",
            headers={"X-Request-Id": request_id},
            json={
                "model": MODEL,
                "messages": HI,
                "stream": stream,
                "stream_options": {"include_usage": True},
            },
        )
    await serve
    assert resp.status_code == 200
    return resp.content


async def test_resume_with_last_event_id(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    full = parse_sse(await _finished_request(app, role, "r-1"))
    assert [e[0] for e in full] == [None, "0", "1", "2", None, None]
    async with http(app) as client:
        resp = await client.get("/v1/requests/r-1/stream", headers={"Last-Event-ID": "0"})
        assert resp.status_code == 200
        assert parse_sse(resp.content) == full[2:]  # tokens 1.., usage, [DONE]
        resp = await client.get("/v1/requests/r-1/stream?last_event_id=2")
        assert parse_sse(resp.content) == full[4:]  # everything delivered: usage, [DONE]
        resp = await client.get("/v1/requests/r-1/stream")
        assert parse_sse(resp.content) == full  # no id: from the start, role event included
        # the same request id posted again reattaches instead of queueing a second request
        same = {"model": MODEL, "messages": HI}
        resp = await client.post(
            "/v1/chat/completions",
            json={**same, "stream": True, "stream_options": {"include_usage": True}},
            headers={"X-Request-Id": "r-1", "Last-Event-ID": "1"},
        )
        assert parse_sse(resp.content) == full[3:]
        resp = await client.post("/v1/chat/completions", json=same, headers={"X-Request-Id": "r-1"})
        body = resp.json()
        assert body["choices"][0]["message"]["content"] == "Hello world!"
        assert body["created"] == json.loads(full[0][1])["created"]
        bad = await client.get("/v1/requests/r-1/stream", headers={"Last-Event-ID": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
        missing = await client.get("/v1/requests/nope/stream")
        assert missing.status_code == 404
    ing = app.state.ingress
    assert (
        await ing.redis.xlen(ing.keys.prefill_stream) + await ing.redis.xlen(ing.keys.decode_stream)
        == 1
    )


async def test_resume_while_generating(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    async with http(app) as client:
        submit = asyncio.create_task(
            client.post(
                "/v1/completions",
                headers={"X-Request-Id": "live-1"},
                json={"model": MODEL, "prompt": "Hi", "stream": True},
            )
        )
        taken = await role.take()
        await role.emit("live-1", TokenChunk(index=0, token_ids=[1], text="a"))
        # a second reader joins after token 0 and sees only what follows
        resumed = asyncio.create_task(
            client.get("/v1/requests/live-1/stream", headers={"Last-Event-ID": "0"})
        )
        await asyncio.sleep(0.05)
        await role.emit(
            "live-1", TokenChunk(index=1, token_ids=[2], text="b", finish_reason="stop")
        )
        await role.finish(taken)
        first, second = await submit, await resumed
    texts = [json.loads(d)["choices"][0]["text"] for _, d in parse_sse(first.content)[:-1]]
    assert texts == ["a", "b"]
    assert [e[0] for e in parse_sse(second.content)] == ["1", None]


async def test_request_state_and_cancel(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    ing = app.state.ingress
    async with http(app) as client:
        pending = asyncio.create_task(
            client.post(
                "/v1/completions",
                headers={"X-Request-Id": "c-1"},
                json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "user": "bob"},
            )
        )
        taken = await role.take()
        state = (await client.get("/v1/requests/c-1")).json()
        fields = (
            "id",
            "status",
            "stage",
            "owner",
            "model",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "user",
            "cancel_requested",
        )
        expected = ("c-1", "decoding", "decode", "w1", MODEL, 1, 0, 0, "bob", False)
        assert tuple(state[k] for k in fields) == expected
        assert isinstance(state["started"], float)
        assert state["deadline"] == pytest.approx(state["created"] + 30.0, abs=0.01)
        resp = await client.delete("/v1/requests/c-1")
        assert resp.json() == {
            "id": "c-1",
            "object": "request.cancel",
            "cancelled": True,
            "status": "decoding",
        }
        assert Progress.parse(await ing.redis.hget(ing.keys.progress, "c-1")).cancelled
        assert (await client.get("/v1/requests/c-1")).json()["cancel_requested"] is True
        # the worker sees the flag and finishes the request as cancelled
        await role.emit("c-1", TokenChunk(index=0, finish_reason="cancelled"))
        await role.finish(taken, "cancelled")
        resp = await pending
        assert resp.json()["choices"][0]["finish_reason"] == "cancelled"
        again = await client.delete("/v1/requests/c-1")
        assert again.json()["cancelled"] is False and again.json()["status"] == "cancelled"
        # issue 46: ended, its progress (and the flag) gone: the record still tells the cancel
        assert await ing.redis.hget(ing.keys.progress, "c-1") is None
        state = (await client.get("/v1/requests/c-1")).json()
        assert (state["status"], state["cancel_requested"]) == ("cancelled", True)
        missing = await client.delete("/v1/requests/none")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "request_not_found"


async def test_failed_record_without_chunk_ends_the_wait(harness):
    factory, worker = harness
    app = factory(read_block_ms=50)
    role = await worker(app)
    async with http(app) as client:
        pending = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Hi"},
                headers={"X-Request-Id": "f-1"},
            )
        )
        taken = await role.take()
        ing = app.state.ingress
        await ing.redis.hset(
            ing.keys.request("f-1"), mapping={"status": "failed", "error": "worker lost"}
        )
        resp = await pending
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "worker lost"
    assert taken.task.request_id == "f-1"


async def test_deadline_gives_504_and_cancels(harness):
    factory, worker = harness
    app = factory(request_timeout_s=0.3)
    await worker(app)
    async with http(app) as client:
        resp = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Hi"},
            headers={"X-Request-Id": "t-1"},
        )
        assert resp.status_code == 504
        assert resp.json()["error"]["code"] == "request_timeout"
        ing = app.state.ingress
        assert Progress.parse(await ing.redis.hget(ing.keys.progress, "t-1")).cancelled
        resp = await client.post(
            "/v1/completions",
            headers={"X-Request-Id": "t-2"},
            json={"model": MODEL, "prompt": "Hi", "stream": True},
        )
        events = parse_sse(resp.content)
        assert json.loads(events[0][1])["error"]["code"] == "request_timeout"
        assert events[-1] == (None, "[DONE]")


async def test_request_state_shows_the_public_fields_with_their_types(harness):
    """Private fields hidden; every public field shown with its type: counts (claim_* too) as
    ints, times as floats, null for a field absent, empty or not a number."""
    factory, _worker = harness
    app = factory()
    ing = app.state.ingress
    record = {
        "status": "decoding",
        "model": MODEL,
        "prompt_tokens": "5",
        "completion_tokens": "-1",
        "cached_tokens": "x",
        "emitted": "2",
        "created": "100.5",
        "deadline": "",
        "user": "",
        "ingress": "{}",
        "key_id": "",
        "attach": "3",
        "submission_id": "ab12",
        "claim_entry": "1-0",
        "claim_emitted": "2",
        "claim_delivery": "1",
    }
    await ing.redis.hset(ing.keys.request("s-1"), mapping=record)
    async with http(app) as client:
        resp = await client.get("/v1/requests/s-1")
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "s-1"
    assert resp.json() == {
        "id": "s-1",
        "object": "request",
        "status": "decoding",
        "stage": None,
        "owner": None,
        "model": MODEL,
        "created": 100.5,
        "updated": None,
        "started": None,
        "deadline": None,
        "prompt_tokens": 5,
        "completion_tokens": -1,
        "cached_tokens": None,
        "draft_tokens": None,
        "accepted_tokens": None,
        "finish_reason": None,
        "error": None,
        "emitted": 2,
        "source": None,
        "user": None,
        "claim_entry": "1-0",
        "claim_emitted": 2,
        "claim_delivery": 1,
        "claim_strikes": None,
        "claim_seen": None,
        "claim_ran": None,
        "cancel_requested": False,
    }
