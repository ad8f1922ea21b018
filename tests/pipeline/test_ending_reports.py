"""Every interface reports a request ended by the system the same way: the SSE error event,
a non-streaming reply, GET /v1/requests/{id} and the producer client (never "finished")."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.client.producer import AsyncClient
from tests.pipeline.ingress_support import MODEL, http, parse_sse

pytestmark = pytest.mark.anyio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
DEADLINE = "the request passed its deadline"
POISON = "delivered 6 times, 5 times its holder died running it without progress (limit 5)"


async def _end(role, taken, chunk: TokenChunk, error: str, reason: str) -> None:
    """What a worker writes: one token, then the ending chunk and the record (failed)."""
    rid = taken.task.request_id
    await role.emit(rid, TokenChunk(index=0, token_ids=[19556], text="Hello"))
    await role.emit(rid, chunk)
    await role.finish(taken, status="failed")
    await role.r.hset(role.keys.request(rid), mapping={"finish_reason": reason, "error": error,
                                                       "emitted": 1})  # fmt: skip


@pytest.mark.parametrize(
    ("reason", "error", "http_status", "code"),
    [("timeout", DEADLINE, 504, "request_timeout"), ("error", POISON, 500, "generation_failed")],
)
async def test_system_ending_is_reported_alike_everywhere(harness, reason, error, http_status,
                                                          code):  # fmt: skip
    factory, worker = harness
    app = factory()
    role = await worker(app)
    rid = f"end-{reason}"

    async def serve() -> None:
        taken = await role.take()
        ending = TokenChunk(index=1, finish_reason=reason, error=error)
        await _end(role, taken, ending, error, reason)

    served = asyncio.create_task(serve())
    async with http(app) as api:
        resp = await api.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": rid})
        await served
        events = [json.loads(d) for _, d in parse_sse(resp.content) if d != "[DONE]"]
        errors = [e["error"] for e in events if "error" in e]
        assert [(e["message"], e["code"]) for e in errors] == [(error, code)]
        whole = await api.post("/v1/chat/completions", json={**CHAT, "stream": False},
                               headers={"X-Request-Id": rid})  # fmt: skip
        assert whole.status_code == http_status
        assert (whole.json()["error"]["message"], whole.json()["error"]["code"]) == (error, code)
        state = (await api.get(f"/v1/requests/{rid}")).json()
        assert (state["status"], state["finish_reason"], state["error"]) == (
            "failed", reason, error)  # fmt: skip
    ing = app.state.ingress
    async with AsyncClient(redis=ing.redis, key_prefix=ing.keys.prefix, model=MODEL) as client:
        done = await client.result(rid)
    assert (done.text, done.finish_reason, done.error) == ("Hello", reason, error)
