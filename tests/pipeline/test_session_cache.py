"""The ingress's side of session retention and prefetch: which session and TTL a task carries
(prompt_cache_key, user, a Responses chain; prompt_cache_retention bounded by the settings),
and the prefetch hint published once a request is queued."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from kvrelay.core.messages import Retention
from kvrelay.core.page_keys import PrefetchHint, page_keys
from kvrelay.pipeline.queue.session_cache import SessionCache
from tests.pipeline.ingress_support import MODEL, MODEL_INFO, http

pytestmark = pytest.mark.anyio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}
ANSWER = [(28, "ok"), (2, "")]


def test_retention_of_a_request():
    cache = SessionCache(redis=None, keys=None, retention_s=600, max_retention_s=3600)
    assert cache.retention(None, None) is None
    assert cache.retention("chat-1", None) == Retention(session="chat-1", ttl_s=600.0)
    assert cache.retention("chat-1", "in_memory") == Retention(session="chat-1", ttl_s=600.0)
    assert cache.retention(None, 30) == Retention(session="(unnamed)", ttl_s=30.0)
    for asked, why in (("24h", "86400 seconds"), (3601, "3601 seconds")):
        try:
            cache.retention("chat-1", asked)
        except Exception as exc:  # noqa: BLE001 - the RequestError's words
            assert why in exc.message and "3600 seconds at most" in exc.message
            assert (exc.status, exc.param) == (400, "prompt_cache_retention")
        else:
            raise AssertionError(f"{asked!r} was accepted")


async def test_tasks_carry_their_session_and_queued_prompts_are_hinted(harness, valkey_session):
    factory, worker = harness
    app = factory(cache_retention_s=120.0)
    role = await worker(app)
    await role.publish_model()  # the fingerprint and page size the keys need
    keys = app.state.ingress.keys
    sub = aioredis.Redis.from_url(valkey_session.url).pubsub()
    await sub.subscribe(keys.prefetch)
    assert (await sub.get_message(timeout=5))["type"] == "subscribe"
    bodies = [
        ({**CHAT, "prompt_cache_key": "conv-9"}, Retention(session="conv-9", ttl_s=120.0)),
        ({**CHAT, "user": "u-1", "prompt_cache_retention": "24h"},
         Retention(session="u-1", ttl_s=86400.0)),
        (CHAT, None),
    ]  # fmt: skip
    async with http(app) as client:
        for body, expected in bodies:
            serve = asyncio.create_task(role.serve_one(ANSWER))
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            task = (await serve).task
            assert task.retention == expected
            msg = await sub.get_message(ignore_subscribe_messages=True, timeout=5)
            assert msg is not None, "no prefetch hint published"
            hint = PrefetchHint.decode(msg["data"])
            ids = task.prompt_token_ids
            fp, size = MODEL_INFO["fingerprint"], MODEL_INFO["page_size"]
            assert hint == PrefetchHint(fp, page_keys(ids[:-1], size, fp))
        # a Responses chain: the first response names the session, its follow-up keeps it
        serve = asyncio.create_task(role.serve_one(ANSWER))
        resp = await client.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
        first = resp.json()["id"]
        assert (await serve).task.retention == Retention(session=first, ttl_s=120.0)
        for _ in range(2):
            serve = asyncio.create_task(role.serve_one(ANSWER))
            body = {"model": MODEL, "input": "More", "previous_response_id": resp.json()["id"]}
            resp = await client.post("/v1/responses", json=body)
            assert resp.status_code == 200, resp.text
            assert (await serve).task.retention == Retention(session=first, ttl_s=120.0)
    await sub.aclose()
