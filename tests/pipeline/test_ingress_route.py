"""Conditional disaggregation: which stream a request goes to, from the real page directory."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.core.messages import DecodeTask, PrefillTask
from kvrelay.core.page_keys import page_keys
from tests.pipeline.ingress_support import MODEL, MODEL_INFO, http

pytestmark = pytest.mark.anyio

PROMPT = list(range(100, 150))  # 50 tokens: 3 full pages of 16 before the last token


async def _route(app, role, prompt, salt=""):
    serve = asyncio.create_task(role.serve_one([(1, "a")]))
    async with http(app) as client:
        resp = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
            | ({"cache_salt": salt} if salt else {}),
        )
    assert resp.status_code == 200, resp.text
    return (await serve).task


async def _store_pages(app, prompt, n, salt=""):
    ing = app.state.ingress
    for key in page_keys(prompt, 16, MODEL_INFO["fingerprint"], salt)[:n]:
        await ing.redis.hset(ing.keys.pages, key.hex(), "node-a")


async def test_auto_routes_by_uncached_tokens(harness):
    factory, worker = harness
    app = factory(route_threshold=20)
    role = await worker(app)
    await role.publish_model()
    await role.heartbeat("p1", "prefill")
    await role.heartbeat("d1", "decode")
    assert isinstance(await _route(app, role, PROMPT[:20]), DecodeTask)  # short prompt
    task = await _route(app, role, PROMPT)
    assert isinstance(task, PrefillTask) and task.num_cached_tokens == 0
    await _store_pages(app, PROMPT, 1)  # 34 uncached > 20: still prefill, 16 known cached
    task = await _route(app, role, PROMPT)
    assert isinstance(task, PrefillTask) and task.num_cached_tokens == 16
    await _store_pages(app, PROMPT, 3)  # 2 uncached tokens: decode computes them itself
    task = await _route(app, role, PROMPT)
    assert isinstance(task, DecodeTask)
    assert (task.prefilled, task.num_cached_tokens, task.num_stored_pages) == (False, 48, 3)
    assert task.prompt_token_ids == PROMPT and task.output_token_ids == []
    # another tenant's salt gives other keys: nothing cached for it
    task = await _route(app, role, PROMPT, salt="tenant-b")
    assert isinstance(task, PrefillTask) and task.cache_salt == "tenant-b"
    ing = app.state.ingress
    state = await ing.redis.hgetall(ing.keys.request(task.request_id))
    assert (state[b"stage"], state[b"cached_tokens"]) == (b"prefill", b"0")


async def test_a_gap_in_the_page_chain_stops_the_count(harness):
    factory, worker = harness
    app = factory(route_threshold=20)
    role = await worker(app)
    await role.publish_model()
    ing = app.state.ingress
    keys = page_keys(PROMPT, 16, MODEL_INFO["fingerprint"])
    for key in (keys[0], keys[2]):
        await ing.redis.hset(ing.keys.pages, key.hex(), "node-a")
    entry = await ing.registry.get(MODEL)
    assert await ing.router.cached_pages(entry, PROMPT, "") == 1


async def test_auto_without_prefill_workers_goes_to_decode(harness):
    factory, worker = harness
    app = factory(route_threshold=4)
    role = await worker(app)
    await role.heartbeat("d1", "decode")
    assert isinstance(await _route(app, role, PROMPT), DecodeTask)
    await role.heartbeat("p1", "prefill")
    assert isinstance(await _route(app, role, PROMPT), PrefillTask)
    await role.r.hset(app.state.ingress.keys.worker("p1"), "draining", 1)
    assert isinstance(await _route(app, role, PROMPT), DecodeTask)


async def test_auto_with_no_live_worker_goes_to_decode(harness):
    # no worker has registered yet (or every one is restarting): a long prompt waits on
    # stream:decode, which every deployment's decode workers read, not on stream:prefill
    factory, worker = harness
    app = factory(route_threshold=4)
    role = await worker(app)
    await role.publish_model()
    task = await _route(app, role, PROMPT)
    assert isinstance(task, DecodeTask) and task.prompt_token_ids == PROMPT
    await role.heartbeat("p1", "prefill")
    assert isinstance(await _route(app, role, PROMPT), PrefillTask)


@pytest.mark.parametrize(
    ("mode", "cls"), [("colocated", DecodeTask), ("disaggregated", PrefillTask)]
)
async def test_fixed_modes(harness, mode, cls):
    factory, worker = harness
    app = factory(mode=mode)
    role = await worker(app)
    await role.publish_model()
    await _store_pages(app, PROMPT, 3)
    assert isinstance(await _route(app, role, PROMPT), cls)
    assert isinstance(await _route(app, role, PROMPT[:2]), cls)
