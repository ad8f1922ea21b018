"""Ingress hardening (issue #10) with a real decode worker (SmolLM2 on CPU, real Valkey):
/health per stage when the only worker drains, and resuming a cut stream within the
disconnect grace (cancelled after it when the client never comes back)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn

from kvrelay.core.keys import MESSAGE_FIELD, Keys
from kvrelay.core.messages import decode_chunks
from kvrelay.pipeline.queue.progress import Progress
from kvrelay.pipeline.server.app import create_app
from tests.conftest import free_port
from tests.pipeline.ingress_support import (
    MODEL,
    http,
    make_config,
    parse_sse,
    running_worker,
    unique_prefix,
)

pytestmark = pytest.mark.anyio

PREFIX = unique_prefix()
KEYS = Keys(PREFIX)
WORKER = "decode-h"
GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def decode_worker(valkey_session):
    """One real decode worker (it prefills locally) under this module's key prefix."""
    with running_worker(valkey_session.url, PREFIX, WORKER) as worker:
        yield worker


async def _until(check, timeout_s: float = 30.0) -> None:
    """Poll `check()` (async) until true; fail the test after `timeout_s`."""
    for _ in range(int(timeout_s / 0.02)):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def _draining(r: aioredis.Redis, value: bytes) -> None:
    await _until(lambda: _equals(r.hget(KEYS.worker(WORKER), "draining"), value))


async def _equals(pending, value) -> bool:
    return await pending == value


@contextlib.asynccontextmanager
async def serving(url: str, tokenizer, **overrides):
    """(base url, app): the ingress under a real uvicorn server, so a client can cut the line."""
    port = free_port()
    app = create_app(
        make_config(url, key_prefix=PREFIX, **overrides), tokenizers={MODEL: tokenizer}
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
        assert not task.done(), "uvicorn failed to start"
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        await task


async def _first_events(client, request_id: str, body: dict, n: int) -> list[tuple[int, str]]:
    """Read `n` token events of a streamed completion, then cut the connection."""
    got: list[tuple[int, str]] = []
    headers = {"X-Request-Id": request_id}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200
        event_id = None
        async for line in resp.aiter_lines():
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: ") and event_id is not None:
                got.append((event_id, json.loads(line[6:])["choices"][0]["text"]))
                event_id = None
                if len(got) == n:
                    break
    return got


async def test_health_names_the_stage_that_cannot_serve(
    valkey_session, smollm_tokenizer, decode_worker
):
    r = aioredis.Redis.from_url(valkey_session.url)
    await _draining(r, b"0")
    auto = create_app(make_config(valkey_session.url, key_prefix=PREFIX), tokenizers={})
    split = create_app(
        make_config(valkey_session.url, key_prefix=PREFIX, mode="disaggregated"), tokenizers={}
    )
    serving_both = {"ready": True, "workers": 1}
    try:
        async with http(auto) as a, http(split) as d:
            resp = await a.get("/health")  # auto mode: the decode worker also prefills
            assert resp.status_code == 200
            body = resp.json()
            assert (body["status"], body["redis"], body["workers"]) == ("ok", True, {"decode": 1})
            assert body["stages"] == {
                "prefill": {**serving_both, "served_by": "decode"},
                "decode": {**serving_both, "served_by": "decode"},
            }
            resp = await d.get("/health")  # disaggregated: prompts wait for a prefill worker
            assert resp.status_code == 503
            assert resp.json()["unavailable_stages"] == ["prefill"]
            assert resp.json()["error"] == (
                "stage prefill cannot serve: no live, non-draining prefill worker"
            )
            await r.hset(KEYS.worker(WORKER), "drain", 1)  # what `kvrelay drain` does
            await _draining(r, b"1")
            resp = await a.get("/health")
            assert resp.status_code == 503
            body = resp.json()
            assert (body["status"], body["workers"]) == ("unavailable", {"decode": 1})
            assert body["unavailable_stages"] == ["prefill", "decode"]
            assert body["stages"]["decode"] == {"ready": False, "workers": 0, "served_by": "decode"}
            assert body["error"] == (
                "stage prefill cannot serve: no live, non-draining decode worker; "
                "stage decode cannot serve: no live, non-draining decode worker"
            )
            await r.hset(KEYS.worker(WORKER), "drain", 0)
            await _draining(r, b"0")
            assert (await a.get("/health")).status_code == 200
    finally:
        await r.hset(KEYS.worker(WORKER), "drain", 0)
        await auto.state.ingress.aclose()
        await split.state.ingress.aclose()
        await r.aclose()


async def test_cut_stream_resumes_within_the_default_grace(
    valkey_session, smollm_tokenizer, decode_worker
):
    rid = "resume-1"
    body = {**GREEDY, "prompt": "List the days of the week:", "max_tokens": 24}
    r = aioredis.Redis.from_url(valkey_session.url)
    try:
        async with (
            serving(valkey_session.url, smollm_tokenizer) as (base, app),  # default grace
            httpx.AsyncClient(base_url=base, timeout=60) as client,
        ):
            assert app.state.ingress.config.disconnect_grace_s == 10.0
            before = await _first_events(client, rid, body, 2)
            last = before[-1][0]
            resp = await client.get(
                f"/v1/requests/{rid}/stream", headers={"Last-Event-ID": str(last)}
            )
            events = parse_sse(resp.content)
        assert events[-1] == (None, "[DONE]")
        after = [(int(i), json.loads(d)["choices"][0]) for i, d in events[:-1] if i is not None]
        assert [i for i, _ in after] == sorted({i for i, _ in after})
        assert all(i > last for i, _ in after)
        assert json.loads(events[-2][1])["choices"][0]["finish_reason"] == "length"
        chunks = [
            c for _, f in await r.xrange(KEYS.out(rid)) for c in decode_chunks(f[MESSAGE_FIELD])
        ]
        full = "".join(c.text for c in chunks)
        assert sum(len(c.token_ids) for c in chunks) == 24
        # every piece of text exactly once: what came before the cut, then the rest
        assert "".join(t for _, t in before) + "".join(c["text"] for _, c in after) == full
        record = await r.hgetall(KEYS.request(rid))
        assert (record[b"status"], record[b"finish_reason"]) == (b"finished", b"length")
    finally:
        await r.aclose()


async def test_a_client_that_never_returns_is_cancelled_after_the_grace(
    valkey_session, smollm_tokenizer, decode_worker
):
    rid = "gone-1"
    body = {**GREEDY, "prompt": "Tell me a very long story.", "max_tokens": 600}  # fits 45 blocks
    r = aioredis.Redis.from_url(valkey_session.url)
    try:
        async with (
            serving(valkey_session.url, smollm_tokenizer, disconnect_grace_s=1.5) as (base, _),
            httpx.AsyncClient(base_url=base, timeout=60) as client,
        ):
            await _first_events(client, rid, body, 1)
            # within the grace: still running, no cancel flag
            assert not Progress.parse(await r.hget(KEYS.progress, rid)).cancelled
            await _until(lambda: _equals(r.hget(KEYS.request(rid), "status"), b"cancelled"))
        record = await r.hgetall(KEYS.request(rid))
        assert record[b"finish_reason"] == b"cancelled"
        assert int(record[b"completion_tokens"]) < 600
    finally:
        await r.aclose()
