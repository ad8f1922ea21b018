"""Clients built from a `redis+sentinel://` URL follow a failover: a real primary, a replica and 3
Sentinels (the configs `kvrelay up --valkey-replicas` writes); the primary SIGKILLed, a replica
promoted, and the next commands of a sync and an asyncio client (after the retry on
ConnectionError their callers have) reach the promoted replica, with what was replicated."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis

from kvrelay.core.redis_client import sync_redis
from kvrelay.pipeline.queue.redis_options import async_redis
from tests.sentinel_group import SentinelGroup


@pytest.fixture
def group(tmp_path):
    g = SentinelGroup(tmp_path, replicas=1, down_after_ms=500)
    g.start()
    yield g
    g.stop()


def retried(call, deadline: float) -> tuple[object, int]:
    """(call's result, ConnectionErrors before it): a worker's retry loop."""
    failures = 0
    while True:
        try:
            return call(), failures
        except redis.ConnectionError:
            failures += 1
            assert time.monotonic() < deadline, "no primary to write to"
            time.sleep(0.05)


async def retried_async(call, deadline: float) -> tuple[object, int]:
    failures = 0
    while True:
        try:
            return await call(), failures
        except redis.ConnectionError:
            failures += 1
            assert time.monotonic() < deadline, "no primary to write to"
            await asyncio.sleep(0.05)


def test_sync_and_async_clients_follow_a_sigkilled_primary_to_the_promoted_replica(group):
    sync = sync_redis(group.url, socket_timeout=2, socket_connect_timeout=2)
    aclient = async_redis(group.url, max_connections=4)
    loop = asyncio.new_event_loop()
    try:
        sync.set("before", "1")
        loop.run_until_complete(aclient.set("before-async", "1"))
        assert sync.wait(1, 2000) == 1  # both writes held by the replica
        assert sync.connection_pool.get_master_address() == ("127.0.0.1", group.node_ports[0])

        group.signal("node-0", signal.SIGKILL)
        deadline = time.monotonic() + 30
        _, failures = retried(lambda: sync.set("after", "sync"), deadline)
        assert failures, "the dead primary's connection did not fail"
        loop.run_until_complete(
            retried_async(lambda: aclient.set("after-async", "async"), deadline)
        )
        # both now talk to the replica, which the Sentinels promoted
        assert group.primary_port() == group.node_ports[1]
        assert group.role(1) == ("master", False)
        promoted = group.client(1)
        assert promoted.mget("before", "before-async", "after", "after-async") == [
            b"1",
            b"1",
            b"sync",
            b"async",
        ]
        promoted.close()
        assert sync.get("after-async") == b"async"
        assert loop.run_until_complete(aclient.get("after")) == b"sync"
    finally:
        sync.close()
        loop.run_until_complete(aclient.aclose())
        loop.close()


def test_a_demoted_primary_is_left_for_the_new_one(group):
    """A graceful failover (SENTINEL FAILOVER) keeps the old primary alive as a replica: a
    client's connection to it fails (READONLY or killed, a ConnectionError either way) and its
    retry writes to the new primary, never to the demoted one."""
    sync = sync_redis(group.url, socket_timeout=2, socket_connect_timeout=2)
    try:
        sync.set("k", "old")
        assert sync.wait(1, 2000) == 1
        sentinel = redis.Redis(port=group.sentinel_ports[0])
        assert sentinel.execute_command("SENTINEL", "FAILOVER", "kvrelay") == b"OK"
        sentinel.close()
        group.wait(lambda: group.primary_port() == group.node_ports[1], "the promotion")
        group.wait_role(0, "slave")
        retried(lambda: sync.set("k", "new"), time.monotonic() + 30)
        demoted, promoted = group.client(0), group.client(1)
        assert promoted.get("k") == b"new"
        group.wait(lambda: demoted.get("k") == b"new", "the demoted node replicating")
        with pytest.raises(redis.ReadOnlyError):
            demoted.set("k", "stale")
        demoted.close()
        promoted.close()
    finally:
        sync.close()


def test_the_replica_ack_timeout_is_an_ingress_setting(tmp_path):
    from kvrelay.core.config import ConfigError
    from kvrelay.pipeline.server.config import load_config

    assert load_config({}).replica_ack_timeout_ms == 1000
    assert load_config({"KVRELAY_INGRESS_REPLICA_ACK_TIMEOUT_MS": "0"}).replica_ack_timeout_ms == 0
    toml = tmp_path / "kvrelay.toml"
    toml.write_text("[ingress]\nreplica_ack_timeout_ms = 250\n")
    assert load_config({}, config_file=str(toml)).replica_ack_timeout_ms == 250
    # WAIT blocks the connection: it must end before the socket's read timeout does
    with pytest.raises(ConfigError, match="^replica_ack_timeout_ms must be >= 0 and below"):
        load_config({"KVRELAY_INGRESS_REPLICA_ACK_TIMEOUT_MS": "60000"})


def test_a_publish_makes_wait_cover_what_other_connections_wrote(tmp_path):
    """Why submission PUBLISHes before its WAIT: WAIT counts the replicas holding the calling
    connection's last propagated command. A retry that finds its request queued by another
    connection writes nothing; without the PUBLISH its WAIT would pass at once with the
    request on no replica."""
    nodes = SentinelGroup(tmp_path, replicas=1)  # the data nodes only: no Sentinel needed
    try:
        nodes.start_node(0)
        nodes.start_node(1)
        nodes.wait_role(1, "slave", link_up=True)
        writer, retry = nodes.client(0), nodes.client(0)
        nodes.signal("node-1", signal.SIGSTOP)
        writer.set("request", "queued")  # held by the primary alone
        assert retry.execute_command("WAIT", 1, 200) == 1  # counts nothing this one wrote
        retry.publish("kvrelay:replicated", "")
        assert retry.execute_command("WAIT", 1, 200) == 0  # now: everything up to here
        nodes.signal("node-1", signal.SIGCONT)
        assert retry.execute_command("WAIT", 1, 5000) == 1
        assert nodes.client(1).get("request") == b"queued"
    finally:
        nodes.stop()
