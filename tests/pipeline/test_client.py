"""The producer client (async and sync) against a real Valkey, next to the ingress."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvrelay.core.keys import Keys
from kvrelay.core.messages import PrefillTask, TokenChunk
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.client.producer import AsyncClient, Client
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.queue.progress import Progress, new_progress
from tests.pipeline.ingress_support import MODEL, WorkerRole, http, unique_prefix

HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.anyio
async def test_client_and_ingress_queue_identical_tasks(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory(mode="disaggregated")
    role = await worker(app)
    ing = app.state.ingress
    async with http(app) as api:
        serve = asyncio.create_task(role.serve_one([(1, "a")]))
        await api.post(
            "/v1/chat/completions",
            headers={"X-Request-Id": "same-1"},
            json={
                "model": MODEL,
                "messages": HI,
                "max_tokens": 8,
                "temperature": 0,
                "seed": 1,
                "cache_salt": "s",
            },
        )
        via_http = (await serve).task
    async with AsyncClient(
        ing.config.redis_url,
        key_prefix=ing.config.key_prefix,
        mode="disaggregated",
        tokenizers={MODEL: smollm_tokenizer},
    ) as client:
        rid = await client.submit(
            messages=HI,
            request_id="same-2",
            cache_salt="s",
            sampling=SamplingParams(max_tokens=8, temperature=0, seed=1),
        )
        assert rid == "same-2"
        via_client = (await role.take()).task
    assert isinstance(via_client, PrefillTask)
    a, b = via_http.to_dict(), via_client.to_dict()
    for varying in ("request_id", "arrival_time", "deadline"):
        a.pop(varying), b.pop(varying)
    assert a == b


@pytest.mark.anyio
async def test_status_is_the_typed_record_get_shows(harness, smollm_tokenizer):
    """Numbers are numbers and absent is null, in status() exactly as over HTTP."""
    factory, worker = harness
    app = factory()
    role = await worker(app)
    ing = app.state.ingress
    async with AsyncClient(
        ing.config.redis_url, key_prefix=ing.keys.prefix, tokenizers={MODEL: smollm_tokenizer}
    ) as client:
        rid = await client.submit("Hello", sampling=SamplingParams(max_tokens=8))
        await role.take()
        await role.emit(rid, TokenChunk(index=0, token_ids=[5, 6], text="ab"))
        state = await client.status(rid)
        async with http(app) as api:
            body = (await api.get(f"/v1/requests/{rid}")).json()
    times = ("created", "updated", "started", "deadline")
    assert all(isinstance(state[name], float) for name in times), state
    assert state["deadline"] == pytest.approx(state["created"] + 600.0, abs=0.01)
    assert {k: v for k, v in state.items() if k not in times} == {
        "status": "decoding",
        "stage": "decode",
        "owner": "w1",
        "model": MODEL,
        "prompt_tokens": 1,
        "completion_tokens": 2,  # while it runs: the live count of its progress
        "cached_tokens": 0,
        "draft_tokens": None,
        "accepted_tokens": None,
        "finish_reason": None,
        "error": None,
        "emitted": 2,
        "source": "client",
        "user": None,
        "claim_entry": None,
        "claim_emitted": None,
        "claim_delivery": None,
        "claim_strikes": None,
        "claim_seen": None,
        "claim_ran": None,
    }
    assert body == {"id": rid, "object": "request", **state, "cancel_requested": False}


@pytest.mark.anyio
async def test_async_stream_resume_and_errors(valkey_session, smollm_tokenizer):
    prefix = unique_prefix()
    role = await WorkerRole(valkey_session.url, Keys(prefix)).setup()
    client = AsyncClient(
        valkey_session.url, key_prefix=prefix, block_ms=100, tokenizers={MODEL: smollm_tokenizer}
    )
    try:
        rid = await client.submit("Hello", sampling=SamplingParams(max_tokens=4))
        taken = await role.take()
        assert taken.task.prompt_token_ids == [19556]
        ids = smollm_tokenizer.encode(" world, hi")
        await role.emit(rid, TokenChunk(index=0, token_ids=ids[:1], text=" world"))
        await role.emit(
            rid,
            TokenChunk(
                index=1,
                token_ids=ids[1:],
                text=", hi",
                finish_reason="stop",
                usage={"prompt_tokens": 1, "completion_tokens": 3},
            ),
        )
        chunks = [c async for c in client.stream(rid)]
        assert [(c.index, c.token_ids, c.text) for c in chunks] == [
            (0, ids[:1], " world"),
            (1, ids[1:], ", hi"),
        ]
        # resume in the middle of the second chunk: cut there, its text decoded again
        resumed = [c async for c in client.stream(rid, start_index=2)]
        assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in resumed] == [
            (2, ids[2:], smollm_tokenizer.decode(ids[2:]), "stop")
        ]
        done = await client.result(rid)
        assert (done.text, done.token_ids, done.finish_reason) == (" world, hi", ids, "stop")
        assert (await client.status(rid))["stage"] == "decode"

        with pytest.raises(RequestError) as info:
            await client.submit("again", request_id=rid)
        assert (info.value.status, info.value.code) == (409, "duplicate_request_id")
        with pytest.raises(RequestError) as info:
            await client.submit("x", model="other-model")
        assert (info.value.status, info.value.code) == (404, "model_not_found")
        with pytest.raises(RequestError) as info:
            await client.submit(prompt_token_ids=[1, 2], sampling=SamplingParams(temperature=-1))
        assert info.value.param == "temperature"
        with pytest.raises(RequestError):
            await client.submit("x", messages=HI)
        assert await client.status("unknown") is None
    finally:
        await client.aclose()
        await role.aclose()


def test_sync_client_for_batch_jobs(valkey_session, smollm_tokenizer):
    prefix = unique_prefix()
    keys = Keys(prefix)

    def answer_two():
        async def run():
            role = await WorkerRole(valkey_session.url, keys).setup()
            for _ in range(2):
                taken = await role.take(timeout_s=10)
                rid = taken.task.request_id
                text = "ok" if taken.task.prompt_token_ids == [5, 6, 7] else "hey"
                await role.emit(
                    rid, TokenChunk(index=0, token_ids=[9], text=text, finish_reason="length")
                )
                await role.finish(taken)
            await role.aclose()

        asyncio.run(run())

    thread = threading.Thread(target=answer_two)
    thread.start()
    with Client(
        valkey_session.url, key_prefix=prefix, tokenizers={MODEL: smollm_tokenizer}
    ) as client:
        rid = client.submit(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=1))
        assert client.result(rid).text == "ok"
        done = client.generate(messages=HI, sampling=SamplingParams(max_tokens=1))
        assert (done.text, done.finish_reason) == ("hey", "length")
        assert [c.text for c in client.stream(rid)] == ["ok"]
        client.cancel(rid)
        state = client.status(rid)
        assert (state["status"], state["prompt_tokens"], state["error"]) == ("finished", 3, None)
    thread.join(timeout=10)
    import redis

    r = redis.Redis.from_url(valkey_session.url)
    assert r.hget(keys.progress, rid) is None  # it had ended: nothing to flag
    r.close()


@pytest.mark.anyio
async def test_generate_follows_through_the_client_feed_and_submit_names_none(
    valkey_session, smollm_tokenizer
):
    prefix = unique_prefix()
    role = await WorkerRole(valkey_session.url, Keys(prefix)).setup()
    client = AsyncClient(
        valkey_session.url, key_prefix=prefix, block_ms=100, tokenizers={MODEL: smollm_tokenizer}
    )
    try:
        batch = await client.submit("Hello", sampling=SamplingParams(max_tokens=4))
        assert await role.r.hget(client.keys.progress, batch) == new_progress()  # no reader
        await role.take()
        done = asyncio.create_task(
            client.generate("Hi", sampling=SamplingParams(max_tokens=1), request_id="g-1")
        )
        taken = await role.take()
        # the request names the client's feed from the start: nothing to attach for
        progress = Progress.parse(await role.r.hget(client.keys.progress, "g-1"))
        assert progress == Progress(feeds=[client.feed.reader_id])
        await role.emit("g-1", TokenChunk(index=0, token_ids=[5], text="x", finish_reason="length"))
        await role.finish(taken)
        result = await done
        assert (result.text, result.finish_reason) == ("x", "length")
        assert client.feed._subs == {}
    finally:
        await client.aclose()
        await role.aclose()


@pytest.mark.anyio
async def test_client_queues_by_priority_and_tenant_under_the_priority_policy(
    valkey_session, smollm_tokenizer
):
    import redis.asyncio as aioredis

    prefix = unique_prefix()
    stream = Keys(prefix).prefill_stream
    opts = dict(key_prefix=prefix, mode="disaggregated", tokenizers={MODEL: smollm_tokenizer})
    async with AsyncClient(valkey_session.url, **opts) as fcfs:
        with pytest.raises(RequestError) as err:
            await fcfs.submit("Hi", priority=3)
        assert (err.value.status, err.value.param) == (400, "priority")
    async with AsyncClient(
        valkey_session.url, **opts, scheduling_policy="priority", tenant="batch", weight=2.0
    ) as client:
        for rid, priority in (("c-0", 5), ("c-1", 5), ("c-2", 1)):
            await client.submit("Hi", request_id=rid, priority=priority)
    r = aioredis.Redis.from_url(valkey_session.url)
    try:
        # c-0 went straight in (nothing waited), the others wait in order
        assert [e[1][b"p"] for e in await r.xrange(stream)] == [b"5"]
        assert await r.zrange(stream + ":wait:bands", 0, -1) == [b"1", b"5"]
        assert await r.hkeys(stream + ":wait:fin") == [b"batch"]
    finally:
        await r.aclose()
