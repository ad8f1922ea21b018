"""Several choices per request through a real decode worker (SmolLM2, real Valkey): choice 0 is
the n=1 answer, choice k the answer of one request with choice k's seed, greedy choices agree,
and a choice's task resumed by another worker (after a restart) continues exactly."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import redis.asyncio as aioredis

from kvrelay.core.keys import MESSAGE_FIELD, Keys
from kvrelay.core.messages import DecodeTask, TokenChunk, decode_chunks, frame
from kvrelay.core.sampling import SamplingParams, choice_seed, derive_seed
from kvrelay.pipeline.queue.progress import Progress
from kvrelay.pipeline.server.app import create_app
from tests.pipeline.ingress_support import (
    MODEL,
    WorkerRole,
    http,
    make_config,
    running_worker,
    unique_prefix,
)

pytestmark = pytest.mark.anyio

PREFIX = "nch:"
KEYS = Keys(PREFIX)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def decode_worker(valkey_session):
    with running_worker(valkey_session.url, PREFIX, "decode-n") as worker:
        yield worker


@pytest.fixture
async def ingress(valkey_session, smollm_tokenizer, decode_worker):
    app = create_app(
        make_config(valkey_session.url, key_prefix=PREFIX), tokenizers={MODEL: smollm_tokenizer}
    )
    try:
        async with http(app) as client:
            yield client
    finally:
        await app.state.ingress.aclose()


def body(**fields):
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, **fields}


async def texts(client, rid: str, **fields) -> list[str]:
    resp = await client.post("/v1/completions", json=body(**fields), headers={"X-Request-Id": rid})
    assert resp.status_code == 200, resp.text
    return [c["text"] for c in resp.json()["choices"]]


async def test_choices_are_single_requests_with_their_seeds(ingress):
    got = await texts(ingress, "nc-3", n=3, temperature=0.8, seed=3)
    assert len(got) == 3 and len(set(got)) == 3  # sampled with three different seeds
    assert await texts(ingress, "nc-1", temperature=0.8, seed=3) == got[:1]  # n=1: choice 0
    for k in (1, 2):
        seed = choice_seed(SamplingParams(seed=3), "nc-3", k)
        assert await texts(ingress, f"nc-seed-{k}", temperature=0.8, seed=seed) == [got[k]]
    # without a seed, choice 0 is what n=1 gives for the same request id
    unseeded = await texts(ingress, "nc-id", n=2, temperature=0.8)
    single = await texts(ingress, "nc-id-1", temperature=0.8, seed=derive_seed("nc-id"))
    assert single == unseeded[:1]


async def test_greedy_choices_are_identical_and_stream_by_index(ingress):
    got = await texts(ingress, "ng-3", n=3, temperature=0)
    assert got[0] == got[1] == got[2] and got[0]
    resp = await ingress.post(
        "/v1/completions",
        json=body(n=2, temperature=0, stream=True, stream_options={"include_usage": True}),
    )
    events = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == {0: got[0], 1: got[0]}
    assert chunks[-1]["usage"]["completion_tokens"] == 16


async def test_a_resumed_choice_continues_exactly(ingress, valkey_session, smollm_tokenizer):
    """Choice 1 of a request, taken over by another worker after its first worker stopped
    with k tokens out: the task the ingress queued, resumed, gives the same tokens."""
    r = aioredis.Redis.from_url(valkey_session.url)
    try:
        reference = await texts(ingress, "nr", n=2, temperature=0.8, seed=11)
        ref = [
            t
            for _, f in await r.xrange(KEYS.out("nr.1"))
            for c in decode_chunks(f[MESSAGE_FIELD])
            for t in c.token_ids
        ]
        assert len(ref) == 8
        # the same request queued where no worker reads: the tasks exactly as queued
        other = create_app(
            make_config(valkey_session.url, key_prefix=unique_prefix()),
            tokenizers={MODEL: smollm_tokenizer},
        )
        role = await WorkerRole(valkey_session.url, other.state.ingress.keys).setup()
        try:
            async with http(other) as client:
                post = asyncio.create_task(
                    client.post(
                        "/v1/completions",
                        json=body(n=2, temperature=0.8, seed=11),
                        headers={"X-Request-Id": "nr"},
                    )
                )
                taken = {t.task.request_id: t.task for t in [await role.take(), await role.take()]}
                post.cancel()
        finally:
            await role.aclose()
            await other.state.ingress.aclose()
        task = taken["nr.1"]
        assert isinstance(task, DecodeTask)
        k, rid = 3, "nr-resumed.1"
        await r.xadd(KEYS.out(rid), {MESSAGE_FIELD: frame(TokenChunk(0, ref[:k]).encode())})
        await r.hset(KEYS.progress, rid, Progress(emitted=k, hist=k).encode())
        resumed = msgspec.structs.replace(task, request_id=rid, output_token_ids=ref[:k])
        await r.xadd(KEYS.decode_stream, {MESSAGE_FIELD: resumed.encode()})
        for _ in range(600):
            chunks = [
                c for _, f in await r.xrange(KEYS.out(rid)) for c in decode_chunks(f[MESSAGE_FIELD])
            ]
            if chunks[-1].finished:
                break
            await asyncio.sleep(0.05)
        assert chunks[1].index == k
        assert [t for c in chunks for t in c.token_ids] == ref
        resumed_text = "".join(c.text for c in chunks[1:])
        assert smollm_tokenizer.decode(ref[:k]) + resumed_text == reference[1]
    finally:
        await r.aclose()


async def test_delete_cancels_every_choice(ingress):
    post = asyncio.create_task(
        ingress.post(
            "/v1/completions",
            json=body(n=3, max_tokens=500, ignore_eos=True, temperature=0.8),
            headers={"X-Request-Id": "nx"},
        )
    )
    for _ in range(400):
        state = (await ingress.get("/v1/requests/nx")).json()
        if state.get("status") == "decoding":
            break
        await asyncio.sleep(0.02)
    resp = await ingress.delete("/v1/requests/nx")
    assert resp.json()["cancelled"] is True
    got = (await post).json()
    assert [c["finish_reason"] for c in got["choices"]] == ["cancelled"] * 3
    assert got["usage"]["completion_tokens"] < 1500
    state = (await ingress.get("/v1/requests/nx")).json()
    assert state["status"] == "cancelled"
    assert [c["status"] for c in state["choices"]] == ["cancelled"] * 3
