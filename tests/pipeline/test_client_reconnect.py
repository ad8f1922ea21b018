"""The producer client's connections die mid-request (the server drops them: CLIENT KILL, as a
proxy or a failover does): it reconnects by itself and goes on from the token it had reached,
none twice and none skipped. It talks to Redis only (no ingress), so these are its connections."""

from __future__ import annotations

import asyncio

import pytest
import redis

from kvrelay.core.keys import Keys
from kvrelay.core.messages import TokenChunk
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.client.producer import AsyncClient
from tests.pipeline.ingress_support import MODEL, WorkerRole, unique_prefix

NAME = "kvrelay-client-under-test"  # CLIENT SETNAME of every connection the client opens


def _kill_client_connections(url: str) -> list[str]:
    """Drop every connection of the client under test; their kinds (`pubsub` or `normal`)."""
    r = redis.Redis.from_url(url)
    try:
        kinds = []
        for c in r.client_list():
            if c.get("name") == NAME:
                assert r.client_kill_filter(_id=c["id"]) == 1
                kinds.append("pubsub" if int(c.get("ssub", 0)) else "normal")
        return sorted(kinds)
    finally:
        r.close()


async def _until(predicate, what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < end, what
        await asyncio.sleep(0.01)


def _view(chunks: list[TokenChunk]) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.finish_reason) for c in chunks]


@pytest.mark.anyio
async def test_stream_and_generate_ride_out_their_connections_being_dropped(
    valkey_session, smollm_tokenizer
):
    prefix = unique_prefix()
    role = await WorkerRole(valkey_session.url, Keys(prefix)).setup()
    client = AsyncClient(
        f"{valkey_session.url}?client_name={NAME}",
        key_prefix=prefix,
        block_ms=100,
        tokenizers={MODEL: smollm_tokenizer},
    )
    try:
        # stream(): attached to a submitted request, cut after its first chunk
        rid = await client.submit("Hello", sampling=SamplingParams(max_tokens=4))
        await role.take()
        got: list[TokenChunk] = []

        async def read(agen) -> None:
            async for chunk in agen:
                got.append(chunk)

        reader = asyncio.create_task(read(client.stream(rid)))
        await role.emit(rid, TokenChunk(index=0, token_ids=[11], text="a"))
        await _until(lambda: len(got) == 1, "the first chunk")
        # both kinds die: the feed's subscription and the pooled command connection
        assert _kill_client_connections(valkey_session.url) == ["normal", "pubsub"]
        # published while nobody listens: the client reads it from the history on reattach
        await role.emit(rid, TokenChunk(index=1, token_ids=[12, 13], text="bc"))
        await _until(lambda: len(got) == 2, "the chunk sent while the connections were down")
        await role.emit(rid, TokenChunk(index=3, token_ids=[14], text="d", finish_reason="length"))
        await asyncio.wait_for(reader, 10)
        assert _view(got) == [
            (0, [11], "a", None),
            (1, [12, 13], "bc", None),
            (3, [14], "d", "length"),
        ]

        # generate(): subscribed before submitting; its connections dropped between chunks
        done = asyncio.create_task(
            client.generate("Hi", sampling=SamplingParams(max_tokens=3), request_id="gen-1")
        )
        taken = await role.take()
        await role.emit("gen-1", TokenChunk(index=0, token_ids=[21], text="x"))
        await asyncio.sleep(0.3)  # the client is reading; its chunk 0 is delivered or pending
        assert "pubsub" in _kill_client_connections(valkey_session.url)
        await role.emit("gen-1", TokenChunk(index=1, token_ids=[22], text="y"))
        await role.emit("gen-1", TokenChunk(index=2, token_ids=[23], text="z",
                                            finish_reason="length"))  # fmt: skip
        await role.finish(taken)
        result = await asyncio.wait_for(done, 10)
        assert (result.token_ids, result.text, result.finish_reason) == ([21, 22, 23], "xyz",
                                                                         "length")  # fmt: skip
    finally:
        await client.aclose()
        await role.aclose()
