"""Command programs (`pipeline.queue.commands`): one generator, run on a sync and an asyncio
client against a real Valkey, gives the same result; a failing call raises where it is run."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

from kvrelay.pipeline.queue.commands import Program, batch, call, run_async, run_sync

pytestmark = pytest.mark.anyio


def _bump(key: str) -> Program[tuple[int, bytes | None]]:
    first = yield call("incr", key)
    yield call("set", f"{key}:seen", first, nx=True)
    now, seen = yield batch([call("incr", key), call("get", f"{key}:seen")])  # one pipeline
    return now, seen


async def test_one_program_on_both_clients(valkey_session) -> None:
    sync = redis.Redis.from_url(valkey_session.url)
    sync.delete("cmd:n", "cmd:n:seen")
    assert run_sync(_bump("cmd:n"), sync) == (2, b"1")
    client = aioredis.Redis.from_url(valkey_session.url)
    try:
        assert await run_async(_bump("cmd:n"), client) == (4, b"1")
        sync.set("cmd:s", "text")
        with pytest.raises(redis.ResponseError):
            await run_async(_bump("cmd:s"), client)
    finally:
        await client.aclose()
    with pytest.raises(redis.ResponseError):
        run_sync(_bump("cmd:s"), sync)
    sync.close()
