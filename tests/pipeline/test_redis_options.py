"""The asyncio client factory: RedisCluster for a cluster node's URL, today's pool otherwise."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
from redis.crc import key_slot
from redis.exceptions import ClusterDownError
from redis.exceptions import ConnectionError as RedisConnectionError

from kvrelay.core import redis_client
from kvrelay.pipeline.queue import redis_options
from kvrelay.pipeline.queue.redis_options import ClusterUnavailable, ResilientCluster, async_redis


@pytest.fixture(autouse=True)
def _fresh_probe_cache(monkeypatch):
    monkeypatch.setattr(redis_client, "_cluster_urls", {})


def test_a_cluster_url_gives_an_asyncio_cluster_client(shared_cluster):
    async def use() -> list:
        aclient = async_redis(shared_cluster.url, max_connections=8)
        try:
            assert type(aclient) is ResilientCluster  # an aiocluster.RedisCluster
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


def test_a_node_that_is_down_is_a_connection_error_the_callers_wait_out(valkey_cluster):
    key = "{b}:s"
    [node] = [
        i
        for i, n in enumerate(valkey_cluster.nodes)
        if n.first_slot <= key_slot(key.encode()) <= n.last_slot
    ]

    async def use() -> BaseException:
        aclient = async_redis(valkey_cluster.url, max_connections=8)
        try:
            await aclient.xadd(key, {"m": b"1"})
            valkey_cluster.stop_node(node, kill=True)
            try:
                await aclient.xadd(key, {"m": b"2"})
            except Exception as exc:  # noqa: BLE001 - the test looks at what it is
                return exc
            raise AssertionError("a write to a dead node's slot went through")
        finally:
            await aclient.aclose()

    assert isinstance(asyncio.run(use()), RedisConnectionError)


def test_cluster_outage_errors_and_redis_internal_failures_become_connection_errors(monkeypatch):
    """CLUSTERDOWN (and TRYAGAIN, an uncovered slot) and an AttributeError raised inside
    redis-py's connection code (its teardown race under node kills) ran nothing: callers retry
    them as lost connections. An AttributeError of ours is not hidden."""
    inside: dict = {"__name__": "redis.asyncio.connection"}
    exec("def send(writer):\n    writer.writelines([])", inside)  # noqa: S102 - a redis-py frame
    failures = iter([ClusterDownError("The cluster is down"), None, None])

    async def execute(self, *args, **kwargs):
        exc = next(failures)
        if exc is not None:
            raise exc
        if args[0] == "GET":
            inside["send"](None)  # AttributeError from a frame of redis-py
        raise AttributeError("ours")

    monkeypatch.setattr(aiocluster.RedisCluster, "execute_command", execute)
    client = ResilientCluster(host="127.0.0.1", port=1)

    async def run(*args):
        try:
            await client.execute_command(*args)
        except Exception as exc:  # noqa: BLE001 - the test looks at what it is
            return exc

    down, torn, ours = asyncio.run(run("SET")), asyncio.run(run("GET")), asyncio.run(run("SET"))
    assert type(down) is ClusterUnavailable and str(down) == "The cluster is down"
    assert type(torn) is ClusterUnavailable and "writelines" in str(torn)
    assert type(ours) is AttributeError and str(ours) == "ours"
    assert redis_options._raised_in_redis(torn.__cause__) and not redis_options._raised_in_redis(
        ours
    )


def test_a_cluster_pipeline_torn_down_under_it_is_a_connection_error(monkeypatch):
    """A pipeline's execute does not go through execute_command: the same AttributeError from
    redis-py's connection code (seen in the sharded chaos test, a node killed under the
    ingress's stream-load pipeline) is a ClusterUnavailable there too."""
    from redis.asyncio.cluster import ClusterPipeline

    inside: dict = {"__name__": "redis.asyncio.connection"}
    exec("def send(writer):\n    writer.writelines([])", inside)  # noqa: S102 - a redis-py frame

    async def execute(self, raise_on_error=True, allow_redirections=True):
        inside["send"](None)

    monkeypatch.setattr(ClusterPipeline, "execute", execute)
    client = ResilientCluster(host="127.0.0.1", port=1)

    async def run():
        pipe = client.pipeline(transaction=False)
        pipe.xlen("s")
        try:
            await pipe.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - the test looks at what it is
            return exc

    torn = asyncio.run(run())
    assert type(torn) is ClusterUnavailable and "writelines" in str(torn)
