"""The sync client factory: a cluster client for a Valkey Cluster node's URL, else a plain one."""

from __future__ import annotations

import logging

import pytest
import redis
from redis.cluster import RedisCluster

from kvrelay.core import redis_client
from kvrelay.core.redis_client import is_cluster, sync_redis
from tests.conftest import free_port


@pytest.fixture(autouse=True)
def _fresh_probe_cache(monkeypatch):
    monkeypatch.setattr(redis_client, "_cluster_urls", {})


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


def test_a_plain_valkey_url_gives_todays_clients(valkey_session):
    assert is_cluster(valkey_session.url) is False
    client = sync_redis(valkey_session.url, socket_timeout=2)
    assert type(client) is redis.Redis
    assert client.get_connection_kwargs()["socket_timeout"] == 2
    client.close()


def test_the_probe_runs_once_per_url_and_can_be_skipped(valkey_session, monkeypatch):
    assert is_cluster(valkey_session.url) is False
    assert redis_client._cluster_urls == {valkey_session.url: False}
    monkeypatch.setattr(redis.Redis, "info", lambda *a, **k: pytest.fail("probed twice"))
    assert is_cluster(valkey_session.url) is False
    assert type(sync_redis("redis://127.0.0.1:1/0", cluster=False)) is redis.Redis  # no probe


def test_an_unreachable_server_counts_as_plain_and_is_asked_again(caplog):
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.INFO, logger=redis_client.__name__):
        assert is_cluster(url) is False
    assert redis_client._cluster_urls == {}  # not remembered: asked again next time
    [record] = caplog.records
    assert record.getMessage().startswith(
        f"cannot tell whether {url.replace('secret', '***')} is a cluster ("
    )


def test_a_cluster_client_that_cannot_reach_its_seed_raises_connection_error():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(redis.ConnectionError, match=f"^Redis Cluster at {url}: "):
        sync_redis(url, cluster=True, socket_connect_timeout=0.5)
