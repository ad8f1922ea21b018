"""ClusterState snapshots: shared fetches, stale worker snapshots refreshed behind requests."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from kvrelay.core.keys import DECODE_GROUP, Keys
from kvrelay.pipeline.queue.cluster import ClusterState, StreamLoad
from tests.pipeline.ingress_support import unique_prefix

pytestmark = pytest.mark.anyio


async def _heartbeat(r: aioredis.Redis, keys: Keys, worker_id: str, role: str) -> None:
    await r.hset(keys.worker(worker_id), mapping={"role": role, "model": "m"})


async def test_stale_workers_are_served_then_refreshed_behind(valkey):
    r, keys = aioredis.Redis.from_url(valkey.url), Keys(unique_prefix())
    cluster = ClusterState(r, keys, refresh_s=0.05)  # workers: ttl 0.2 s, served up to 6.2 s
    try:
        await _heartbeat(r, keys, "d1", "decode")
        assert await cluster.roles("m") == {"decode": 1}
        await _heartbeat(r, keys, "p1", "prefill")
        await asyncio.sleep(0.25)
        assert await cluster.roles("m") == {"decode": 1}  # stale, but no SCAN on the request
        cluster.refresh_behind()
        await asyncio.sleep(0.1)
        assert await cluster.roles("m") == {"decode": 1, "prefill": 1}
        assert [w.worker_id for w in await cluster.workers(fresh=True)] in (
            ["d1", "p1"],
            ["p1", "d1"],
        )
    finally:
        cluster.close()
        await r.aclose()


async def test_zero_refresh_always_reads_current_state(valkey):
    r, keys = aioredis.Redis.from_url(valkey.url), Keys(unique_prefix())
    cluster = ClusterState(r, keys, refresh_s=0.0)
    try:
        await _heartbeat(r, keys, "d1", "decode")
        assert await cluster.roles("m") == {"decode": 1}
        await _heartbeat(r, keys, "p1", "prefill")
        assert await cluster.roles("m") == {"decode": 1, "prefill": 1}
    finally:
        cluster.close()
        await r.aclose()


async def test_concurrent_readers_share_one_fetch_and_load_is_pipelined(valkey):
    r, keys = aioredis.Redis.from_url(valkey.url), Keys(unique_prefix())
    cluster = ClusterState(r, keys, refresh_s=10.0)
    try:
        # no streams yet: nothing queued
        empty = ClusterState(r, Keys(unique_prefix()))
        assert await empty.load() == {"prefill": StreamLoad(), "decode": StreamLoad()}
        await r.xadd(keys.prefill_stream, {"m": b"x"})
        await r.xadd(keys.decode_stream, {"m": b"y"})
        await r.xgroup_create(keys.decode_stream, DECODE_GROUP, id="0")
        await r.xadd(keys.decode_stream, {"m": b"z"})
        before = int((await r.info("commandstats"))["cmdstat_xinfo|groups"]["calls"])
        cluster.prefetch(workers=False)
        loads = await asyncio.gather(*(cluster.load(fresh=False) for _ in range(5)))
        after = int((await r.info("commandstats"))["cmdstat_xinfo|groups"]["calls"])
        assert after - before == 2  # one fetch (both streams in one round trip), five readers
        expected = {"prefill": StreamLoad(waiting=1), "decode": StreamLoad(waiting=2)}
        assert loads == [expected] * 5
    finally:
        cluster.close()
        await r.aclose()
