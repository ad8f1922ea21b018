"""Three pipeline shards on one plain Valkey, through the real ingress and a real decode worker
(SmolLM2): requests on every shard answer exactly what one shard answers, any ingress finds a
request's state and resumes its stream from its id alone, and a process with another shard
count is refused."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

from kvrelay.core.keys import Keys
from kvrelay.pipeline.queue.shard_count import (
    ShardCountError,
    check_shard_count,
    check_shard_count_sync,
)
from kvrelay.pipeline.server.app import create_app
from tests.pipeline.ingress_support import MODEL, http, make_config, parse_sse, running_worker
from tests.queue_state import ids_on_every_shard

pytestmark = pytest.mark.anyio

ONE, THREE = "shd1:", "shd3:"
PROMPT = "The capital of France is"
GREEDY_8 = {"max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def workers(valkey_session):
    with (
        running_worker(valkey_session.url, ONE, "dec-one") as one,
        running_worker(
            valkey_session.url, THREE, "dec-three", loaded=one.engine.loaded, shards=3
        ) as three,
    ):
        yield one, three


@pytest.fixture
async def ingresses(valkey_session, smollm_tokenizer, workers):
    tokenizers = {MODEL: smollm_tokenizer}
    apps = [
        create_app(make_config(valkey_session.url, key_prefix=ONE), tokenizers=tokenizers),
        create_app(
            make_config(valkey_session.url, key_prefix=THREE, shards=3), tokenizers=tokenizers
        ),
        create_app(
            make_config(valkey_session.url, key_prefix=THREE, shards=3), tokenizers=tokenizers
        ),
    ]
    try:
        async with http(apps[0]) as one, http(apps[1]) as first, http(apps[2]) as second:
            yield one, first, second
    finally:
        for app in apps:
            await app.state.ingress.aclose()


async def complete(client, rid: str, **fields) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_every_shard_answers_as_one_shard_does(ingresses, valkey_session):
    one, first, second = ingresses
    expected = (await complete(one, "one-ref"))["choices"][0]["text"]
    assert expected  # eight greedy tokens
    r = redis.Redis.from_url(valkey_session.url)
    rids = ids_on_every_shard("shd")
    for shard, rid in enumerate(rids):
        got = await complete(first, rid)
        assert got["choices"][0]["text"] == expected
        assert got["usage"]["completion_tokens"] == 8
        keys = Keys(THREE, shard, 3)
        assert r.hget(keys.request(rid), "status") == b"finished"
        assert r.exists(keys.out(rid)) == 1
        others = [Keys(THREE, k, 3) for k in range(3) if k != shard]
        assert [r.exists(k.request(rid)) for k in others] == [0, 0]
        # the worker served the shard's own stream: its entry was read and acked there
        assert r.xlen(keys.decode_stream) >= 1
        # any ingress answers for it from its id
        state = await second.get(f"/v1/requests/{rid}")
        assert state.status_code == 200, state.text
        assert (state.json()["status"], state.json()["completion_tokens"]) == ("finished", 8)
    r.close()


async def test_a_second_ingress_resumes_a_stream_and_choices_share_a_shard(ingresses):
    one, first, second = ingresses
    ref = await complete(one, "one-ref-stream")
    expected = ref["choices"][0]["text"]
    for rid in ids_on_every_shard("shd-resume"):
        got = await complete(first, rid)
        assert got["choices"][0]["text"] == expected
        resp = await second.get(f"/v1/requests/{rid}/stream", headers={"Last-Event-ID": "3"})
        assert resp.status_code == 200, resp.text
        events = parse_sse(resp.content)
        assert events[-1] == (None, "[DONE]")
        ids = [int(i) for i, _ in events[:-1] if i is not None]
        assert ids and ids[0] == 4  # the chunks after token 3
    # a request of several choices: the parent and every choice on one shard
    for rid in ids_on_every_shard("shd-n"):
        got = await complete(first, rid, n=2)
        assert [c["text"] for c in got["choices"]] == [expected, expected]
        state = await second.get(f"/v1/requests/{rid}")
        assert state.json()["status"] == "finished"


async def test_another_shard_count_is_refused(valkey_session, workers):
    r, client = (
        redis.Redis.from_url(valkey_session.url),
        aioredis.Redis.from_url(valkey_session.url),
    )
    assert r.get(Keys(THREE).shard_count) == b"3"  # the first process wrote it
    assert check_shard_count_sync(r, Keys(THREE, shards=3)) == 3
    with pytest.raises(ShardCountError, match="has 2 pipeline shard.s. but the stack .* runs 3"):
        check_shard_count_sync(r, Keys(THREE, shards=2))
    with pytest.raises(ShardCountError, match="has 1 pipeline shard.s. but the stack .* runs 3"):
        await check_shard_count(client, Keys(THREE))
    await client.aclose()
    r.close()


async def test_the_producer_client_submits_to_each_shard(
    valkey_session, workers, ingresses, smollm_tokenizer
):
    from kvrelay.pipeline.client.producer import AsyncClient

    one = ingresses[0]
    expected = (await complete(one, "one-ref-client"))["choices"][0]["text"]
    tokenizers = {MODEL: smollm_tokenizer}
    async with AsyncClient(
        valkey_session.url, key_prefix=THREE, shards=3, tokenizers=tokenizers
    ) as client:
        for rid in ids_on_every_shard("shd-client"):
            done = await client.generate(PROMPT, request_id=rid, sampling=GREEDY_8)
            assert done.text == expected
            status = await client.status(rid)
            assert status is not None and status["status"] == "finished"
        # submitted without a reader, then read from its shard's history
        rid = ids_on_every_shard("shd-client-later")[1]
        assert await client.submit(PROMPT, request_id=rid, sampling=GREEDY_8) == rid
        assert (await client.result(rid)).text == expected
    with pytest.raises(ShardCountError):
        async with AsyncClient(
            valkey_session.url, key_prefix=THREE, shards=2, tokenizers=tokenizers
        ) as client:
            await client.submit(PROMPT, sampling=GREEDY_8)
    # no count given (nor KVRELAY_SHARDS): the client takes the stack's from its Redis, so the
    # Valkey URL alone reads a request of any shard
    async with AsyncClient(valkey_session.url, key_prefix=THREE, tokenizers=tokenizers) as client:
        assert client.keys.shards == 1  # until it has asked
        assert (await client.result(rid)).text == expected and client.keys.shards == 3
        later = ids_on_every_shard("shd-client-url-only")[2]
        assert (await client.generate(PROMPT, request_id=later, sampling=GREEDY_8)).text == expected
