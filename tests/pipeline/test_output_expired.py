"""An ended request whose out:{id} expired (req:{id} outlives it) is 410 output_expired.

The expired state is made directly in Redis (a req:{id} record that says the request ended, no
out:{id}) rather than waiting for the workers' 10-minute out_ttl.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvrelay.core.messages import TokenChunk, frame
from kvrelay.pipeline.client.producer import AsyncClient, OutputExpired, OutputTimeout
from tests.pipeline.ingress_support import MODEL, http, parse_sse, unique_prefix

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]
CHAT = {"model": MODEL, "messages": HI}


def gone_body(request_id: str) -> dict:
    return {
        "error": {
            "message": f"request {request_id} has ended and its output has expired; its state "
            f"is still at GET /v1/requests/{request_id}",
            "type": "invalid_request_error",
            "param": None,
            "code": "output_expired",
        }
    }


@pytest.fixture
async def client(valkey_session, smollm_tokenizer):
    made = AsyncClient(
        valkey_session.url,
        key_prefix=unique_prefix(),
        block_ms=100,
        tokenizers={MODEL: smollm_tokenizer},
    )
    yield made
    await made.aclose()


async def _record(client: AsyncClient, request_id: str, **fields) -> None:
    await client.redis.hset(client.keys.request(request_id), mapping={"model": MODEL, **fields})


@pytest.mark.parametrize(
    ("status", "deadline_in_s"),
    [("finished", -100), ("finished", 300), ("cancelled", -100), ("failed", 300)],
)
async def test_client_reports_expired_output(client, status, deadline_in_s):
    deadline = f"{time.time() + deadline_in_s:.3f}"
    await _record(client, "gone-1", status=status, emitted=3, deadline=deadline)
    with pytest.raises(OutputExpired) as info:
        await client.result("gone-1")
    assert str(info.value) == f"request gone-1 {status} and its output has expired"
    assert (info.value.request_id, info.value.status) == ("gone-1", status)
    with pytest.raises(OutputExpired):
        [c async for c in client.stream("gone-1", start_index=1)]


async def test_client_still_times_out_a_running_request(client):
    await _record(client, "slow-1", status="decoding", deadline=f"{time.time() - 100:.3f}")
    with pytest.raises(OutputTimeout):
        await client.result("slow-1")


async def test_failed_before_any_token_reports_its_error(client):
    # dead-lettered before a token: out:{id} may never have existed, the record tells it all
    await _record(client, "dead-1", status="failed", error="worker lost", deadline="")
    done = await client.result("dead-1")
    assert (done.finish_reason, done.error, done.token_ids) == ("error", "worker lost", [])


async def test_output_still_kept_is_read(client):
    await _record(client, "kept-1", status="finished", emitted=1, deadline="")
    chunk = TokenChunk(index=0, token_ids=[19556], text="Hello", finish_reason="stop")
    await client.redis.xadd(client.keys.out("kept-1"), {"m": frame(chunk.encode())})
    done = await client.result("kept-1")
    assert (done.text, done.finish_reason) == ("Hello", "stop")


async def _finished_then_expired(app, role, request_id: str) -> None:
    serve = asyncio.create_task(role.serve_one([(19556, "Hello")]))
    async with http(app) as api:
        resp = await api.post(
            "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": request_id}
        )
    await serve
    assert resp.status_code == 200
    ing = app.state.ingress
    assert await ing.redis.delete(ing.keys.out(request_id)) == 1  # what out_ttl does


async def test_http_reattach_after_expiry_is_410(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    await _finished_then_expired(app, role, "old-1")
    async with http(app) as api:
        resumed = await api.get("/v1/requests/old-1/stream")
        assert (resumed.status_code, resumed.json()) == (410, gone_body("old-1"))
        assert resumed.headers["content-type"] == "application/json"
        assert resumed.headers["x-request-id"] == "old-1"
        for stream in (False, True):
            again = await api.post(
                "/v1/chat/completions",
                json={**CHAT, "stream": stream},
                headers={"X-Request-Id": "old-1"},
            )
            assert (again.status_code, again.json()) == (410, gone_body("old-1"))
        state = await api.get("/v1/requests/old-1")
        assert (state.status_code, state.json()["status"]) == (200, "finished")
        ing = app.state.ingress
        assert await ing.redis.hget(ing.keys.progress, "old-1") is None  # ended: no flag


async def test_http_output_expiring_while_waited_on(harness):
    factory, worker = harness
    app = factory(read_block_ms=50)
    role = await worker(app)
    ing = app.state.ingress
    async with http(app) as api:
        for request_id, stream in (("mid-1", False), ("mid-2", True)):
            pending = asyncio.create_task(
                api.post(
                    "/v1/chat/completions",
                    json={**CHAT, "stream": stream},
                    headers={"X-Request-Id": request_id},
                )
            )
            await role.take()
            # the worker wrote two tokens and finished long ago; out:{id} has expired since
            await ing.redis.hset(
                ing.keys.request(request_id), mapping={"status": "finished", "emitted": 2}
            )
            resp = await pending
            if not stream:
                assert (resp.status_code, resp.json()) == (410, gone_body(request_id))
                continue
            assert resp.status_code == 200  # the stream had started: the error is an event
            events = [data for _, data in parse_sse(resp.content)]
            assert json.loads(events[0])["choices"][0]["delta"] == {
                "role": "assistant",
                "content": "",
            }
            assert json.loads(events[1]) == gone_body(request_id)
            assert events[2:] == ["[DONE]"]
