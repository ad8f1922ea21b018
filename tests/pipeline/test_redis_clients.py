"""The client factory: a cluster client for a Valkey Cluster node's URL, a plain one otherwise."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
from redis.cluster import RedisCluster

from kvrelay.pipeline.queue import redis_options
from kvrelay.pipeline.queue.redis_options import async_redis, is_cluster, sync_redis
from tests.conftest import free_port


@pytest.fixture(autouse=True)
def _fresh_probe_cache(monkeypatch):
    monkeypatch.setattr(redis_options, "_cluster_urls", {})


def test_a_cluster_url_gives_cluster_clients(shared_cluster):
    assert is_cluster(shared_cluster.url) is True
    client = sync_redis(shared_cluster.url, socket_timeout=2)
    try:
        assert type(client) is RedisCluster
        for tag in ("a", "b", "c"):  # one key on each node
            client.set(f"{{{tag}}}:k", tag)
        pipe = client.pipeline(transaction=False)
        for tag in ("a", "b", "c"):
            pipe.get(f"{{{tag}}}:k")
        assert pipe.execute() == [b"a", b"b", b"c"]
        assert sorted(client.scan_iter(match="{*}:k")) == [b"{a}:k", b"{b}:k", b"{c}:k"]
    finally:
        client.close()

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


def test_a_plain_valkey_url_gives_todays_clients(valkey_session):
    assert is_cluster(valkey_session.url) is False
    client = sync_redis(valkey_session.url, socket_timeout=2)
    assert type(client) is redis.Redis
    assert client.get_connection_kwargs()["socket_timeout"] == 2
    client.close()

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


def test_the_probe_runs_once_per_url_and_can_be_skipped(valkey_session, monkeypatch):
    assert is_cluster(valkey_session.url) is False
    assert redis_options._cluster_urls == {valkey_session.url: False}
    monkeypatch.setattr(redis.Redis, "info", lambda *a, **k: pytest.fail("probed twice"))
    assert is_cluster(valkey_session.url) is False
    assert type(sync_redis("redis://127.0.0.1:1/0", cluster=False)) is redis.Redis  # no probe


def test_an_unreachable_server_counts_as_plain_and_is_asked_again(caplog):
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger=redis_options.__name__):
        assert is_cluster(url) is False
    assert redis_options._cluster_urls == {}  # not remembered: asked again next time
    [record] = caplog.records
    assert record.getMessage().startswith(
        f"cannot tell whether {url.replace('secret', '***')} is a cluster ("
    )


def test_a_cluster_client_that_cannot_reach_its_seed_raises_connection_error():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(redis.ConnectionError, match=f"^Redis Cluster at {url}: "):
        sync_redis(url, cluster=True, socket_connect_timeout=0.5)
