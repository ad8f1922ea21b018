"""The asyncio client factory: RedisCluster for a cluster node's URL, today's pool otherwise."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster

from kvrelay.core import redis_client
from kvrelay.pipeline.queue.redis_options import async_redis


@pytest.fixture(autouse=True)
def _fresh_probe_cache(monkeypatch):
    monkeypatch.setattr(redis_client, "_cluster_urls", {})


def test_a_cluster_url_gives_an_asyncio_cluster_client(shared_cluster):
    async def use() -> list:
        aclient = async_redis(shared_cluster.url, max_connections=8)
        try:
            assert type(aclient) is aiocluster.RedisCluster
            await aclient.xadd("{b}:s", {"m": b"1"})
            # a blocking read outlives the cluster client's 5 s default socket timeout: None here
            assert aclient.get_connection_kwargs()["socket_timeout"] is None
            return await aclient.xread({"{b}:s": "0"}, block=100)
        finally:
            await aclient.aclose()

    [[stream, entries]] = asyncio.run(use())
    assert stream == b"{b}:s" and [fields for _id, fields in entries] == [{b"m": b"1"}]


def test_a_plain_valkey_url_gives_todays_waiting_pool(valkey_session):
    async def make():
        aclient = async_redis(valkey_session.url, max_connections=8, pool_timeout_s=1.5)
        try:
            assert type(aclient) is aioredis.Redis
            pool = aclient.connection_pool
            assert (type(pool), pool.max_connections, pool.timeout) == (
                aioredis.BlockingConnectionPool,
                8,
                1.5,
            )
            assert await aclient.ping() is True
        finally:
            await aclient.aclose()

    asyncio.run(make())
