"""`redis+sentinel://` URLs: parsed exactly, checked with the other Redis URLs, and turned by the
client factories into clients on redis-py's Sentinel pools (no server needed for these)."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from kvrelay.core import config, redis_client
from kvrelay.core.redis_client import is_cluster, sync_redis
from kvrelay.core.sentinel_url import SentinelUrl, parse_sentinel_url
from kvrelay.pipeline.queue.redis_options import (
    BlockingSentinelPool,
    async_redis,
    replicated,
)


def test_a_sentinel_url_is_parsed_into_its_parts():
    assert parse_sentinel_url("redis+sentinel://10.0.0.1:26379,h2:26380/kvrelay/3") == (
        SentinelUrl((("10.0.0.1", 26379), ("h2", 26380)), "kvrelay", 3)
    )
    assert parse_sentinel_url("redis+sentinel://:s%40cret@h/mymaster") == SentinelUrl(
        (("h", 26379),), "mymaster", 0, None, "s@cret"
    )
    assert parse_sentinel_url("redis+sentinel://u:p@[::1]:5000/m/") == SentinelUrl(
        (("::1", 5000),), "m", 0, "u", "p"
    )
    url = "redis+sentinel://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3/kvrelay/0"
    assert parse_sentinel_url(url).url() == url


FORM = "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]"
BAD = [
    ("redis+sentinel://h:1", f"a Sentinel URL needs the master name ({FORM})"),
    ("redis+sentinel://h:1/", f"a Sentinel URL needs the master name ({FORM})"),
    ("redis+sentinel:///m", f"a Sentinel URL needs at least one HOST:PORT ({FORM})"),
    ("redis+sentinel://h:1,,h:2/m", f"a Sentinel URL needs at least one HOST:PORT ({FORM})"),
    ("redis+sentinel://h:99999/m", "the port must be 1-65535, got '99999'"),
    ("redis+sentinel://h:x/m", "the port must be 1-65535, got 'x'"),
    ("redis+sentinel://:1/m", "a Sentinel address needs a host, got ':1'"),
    ("redis+sentinel://h:1/m/zero", "the database must be a number, got 'zero'"),
    ("redis+sentinel://h:1/m/0/x", f"too many path parts ({FORM})"),
]


@pytest.mark.parametrize(("url", "problem"), BAD, ids=[u for u, _ in BAD])
def test_a_malformed_sentinel_url_is_named_with_what_is_wrong(url, problem):
    assert config.redis_url_problem(url) == problem
    with pytest.raises(config.ConfigError, match="^invalid Redis URL"):
        config.check_redis_url(url, "--redis-url")


def test_a_good_sentinel_url_passes_the_settings_check():
    assert config.redis_url_problem("redis+sentinel://127.0.0.1:26379,h:1/kvrelay/0") is None


def test_the_factories_build_sentinel_clients_without_probing(monkeypatch):
    url = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/kvrelay/4"
    monkeypatch.setattr(redis_client, "_cluster_urls", {})
    assert is_cluster(url) is False  # no server asked (none listens there)
    assert redis_client._cluster_urls == {}
    client = sync_redis(url, cluster=None, socket_timeout=3, health_check_interval=10)
    pool = client.connection_pool
    assert type(pool) is redis.sentinel.SentinelConnectionPool
    assert (pool.service_name, pool.is_master) == ("kvrelay", True)
    assert pool.connection_kwargs["db"] == 4
    assert pool.connection_kwargs["socket_timeout"] == 3
    assert pool.connection_kwargs["health_check_interval"] == 10
    assert [s.get_connection_kwargs()["port"] for s in pool.sentinel_manager.sentinels] == [1, 2]
    client.close()

    aclient = async_redis(url, max_connections=7, pool_timeout_s=2.5)
    apool = aclient.connection_pool
    assert type(apool) is BlockingSentinelPool
    assert isinstance(apool, aiosentinel.SentinelConnectionPool)
    assert (apool.max_connections, apool.timeout) == (7, 2.5)
    assert apool.connection_kwargs["db"] == 4
    assert replicated(aclient) is True
    asyncio.run(aclient.aclose())


def test_no_sentinel_answering_is_a_connection_error():
    client = sync_redis("redis+sentinel://127.0.0.1:1/kvrelay/0", socket_timeout=0.5)
    with pytest.raises(redis.ConnectionError, match="No master found for 'kvrelay'"):
        client.ping()
    client.close()
