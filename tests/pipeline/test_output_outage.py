"""Reading a request's output across a Valkey restart: the feed reader waits the outage out (the
request lives on in the append-only file), attaches again and yields every token once; a
longer outage is reported."""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from kvrelay.core.keys import Keys
from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.queue import outage as outage_module
from kvrelay.pipeline.queue.feed import OutputFeed
from kvrelay.pipeline.queue.redis_options import async_redis
from tests.pipeline.queue_sim import emit, submit

KEYS = Keys("oo:")


def _emit(url: str, chunk: TokenChunk) -> None:
    r = redis.Redis.from_url(url)
    emit(r, KEYS, "q", chunk)
    r.close()


async def _read(url: str, retry_s: float, got: list[TokenChunk], ready: asyncio.Event) -> None:
    client = async_redis(url, 8)
    feed = OutputFeed(client, KEYS, block_ms=100, redis_retry_s=retry_s, quiet_s=0.2)
    try:
        sub = await feed.subscribe("q")
        r = redis.Redis.from_url(url)
        submit(r, KEYS, "q", feed.reader_id)
        r.close()
        ready.set()
        async for chunk in sub.chunks(submitted=True):
            got.append(chunk)
    finally:
        await feed.stop()
        await client.aclose()


async def _first_chunk_read(url: str, retry_s: float, got: list[TokenChunk]) -> asyncio.Task:
    """A reader (the task returned, collecting into `got`) that already has chunk 0."""
    ready = asyncio.Event()
    reader = asyncio.create_task(_read(url, retry_s, got, ready))
    await ready.wait()
    await asyncio.to_thread(_emit, url, TokenChunk(0, [11], "a"))
    while not got:
        await asyncio.sleep(0.02)
    return reader


def test_reader_survives_a_valkey_restart(valkey):
    got: list[TokenChunk] = []

    async def scenario() -> None:
        reader = await _first_chunk_read(valkey.url, 30.0, got)
        assert [c.index for c in got] == [0]
        await asyncio.sleep(1.1)  # the append-only file is synced every second
        valkey.stop(kill=True)  # SIGKILL: what the chaos test does to it
        await asyncio.sleep(1.0)  # the reader is now failing to reach it, and waiting
        await asyncio.to_thread(valkey.start)
        await asyncio.to_thread(_emit, valkey.url, TokenChunk(1, [12], "b"))
        await asyncio.to_thread(_emit, valkey.url, TokenChunk(2, [13], "c", finish_reason="length"))
        await asyncio.wait_for(reader, 20)

    asyncio.run(scenario())
    assert [(c.index, c.token_ids, c.text) for c in got] == [(0, [11], "a"), (1, [12], "b"),
                                                             (2, [13], "c")]  # fmt: skip
    assert got[-1].finish_reason == "length"


def test_an_outage_longer_than_the_retry_window_is_raised(valkey, fake_clock):
    got: list[TokenChunk] = []
    fake_clock.install(outage_module)  # the outage's clock moves only as the reader waits

    async def scenario() -> None:
        reader = await _first_chunk_read(valkey.url, 1.0, got)
        valkey.stop(kill=True)
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(reader, 20)

    asyncio.run(scenario())
    assert [c.index for c in got] == [0]
    # retried with pauses for exactly the 1 s retry window, then raised
    assert len(fake_clock.slept) > 1 and fake_clock.waited == pytest.approx(1.0, abs=1e-3)
