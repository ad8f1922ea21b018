"""A local Valkey Cluster (real valkey-server nodes): slots, hash tags, Lua, restarts."""

from __future__ import annotations

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from kvrelay.cli.up.valkey import free_ports
from kvrelay.cli.up.valkey_cluster import (
    ClusterError,
    cluster_info,
    form,
    node_status,
    own_slots,
    slot_ranges,
)
from tests.conftest import ValkeyCluster

THIRDS = [(0, 5461), (5462, 10922), (10923, 16383)]


def test_slot_ranges_split_every_slot_evenly():
    assert slot_ranges(1) == [(0, 16383)]
    assert slot_ranges(3) == THIRDS
    sixteen = slot_ranges(16)
    assert sixteen[0] == (0, 1023) and sixteen[-1] == (15360, 16383)
    assert {last - first + 1 for first, last in sixteen} == {1024}
    assert sum(last - first + 1 for first, last in slot_ranges(7)) == 16384
    with pytest.raises(ValueError, match="shards must be 1-16384, got 0"):
        slot_ranges(0)


def test_three_nodes_cover_every_slot_and_agree(shared_cluster):
    for i, (first, last) in enumerate(THIRDS):
        client = shared_cluster.client(i)
        assert own_slots(client) == [(first, last)]
        info = cluster_info(client)
        assert info["cluster_state"] == "ok"
        assert info["cluster_slots_assigned"] == "16384"
        assert info["cluster_known_nodes"] == "3"
        assert info["cluster_size"] == "3"
    served = shared_cluster.client(0).execute_command("CLUSTER", "SLOTS")
    slots = sorted((a, b, node[1]) for a, b, node, *_ in served)
    assert slots == [(a, b, n.port) for (a, b), n in zip(THIRDS, shared_cluster.nodes, strict=True)]
    assert form(shared_cluster.nodes, timeout_s=10) is False  # formed already: nothing assigned


def test_hash_tags_land_on_the_node_serving_their_slot(shared_cluster):
    tags = {"b": 0, "c": 1, "a": 2}  # slots 3300, 7365, 15495
    assert [key_slot(f"{{{t}}}:k".encode()) for t in tags] == [3300, 7365, 15495]
    rc = RedisCluster.from_url(shared_cluster.url)
    try:
        for tag in tags:
            rc.set(f"{{{tag}}}:k", tag)
        for tag, node in tags.items():
            plain = shared_cluster.client(node)
            assert plain.keys() == [f"{{{tag}}}:k".encode()]
            assert plain.get(f"{{{tag}}}:k") == tag.encode()
        assert [rc.get(f"{{{t}}}:k") for t in tags] == [b"b", b"c", b"a"]
    finally:
        rc.close()


def test_a_lua_script_on_one_hash_tag_runs_and_a_cross_slot_one_is_refused(shared_cluster):
    rc = RedisCluster.from_url(shared_cluster.url)
    try:
        script = rc.register_script(
            "redis.call('XADD', KEYS[1], '*', 'm', ARGV[1]) "
            "return redis.call('HINCRBY', KEYS[2], 'n', redis.call('XLEN', KEYS[1]))"
        )
        assert script(keys=["{a}:stream", "{a}:prog"], args=["x"]) == 1
        assert script(keys=["{a}:stream", "{a}:prog"], args=["y"]) == 3
        assert shared_cluster.client(2).xlen("{a}:stream") == 2  # slot 15495: the third node
        with pytest.raises(
            redis.exceptions.RedisClusterException,
            match="^EVALSHA - all keys must map to the same key slot$",
        ):
            script(keys=["{a}:stream", "{b}:prog"], args=["z"])
    finally:
        rc.close()


def test_restarted_nodes_keep_their_slots_and_keys_from_nodes_conf(valkey_cluster):
    rc = RedisCluster.from_url(valkey_cluster.url)
    try:
        rc.set("{c}:kept", "1")  # slot 7365: the second node
    finally:
        rc.close()
    valkey_cluster.stop_node(1, kill=True)  # SIGKILL: nodes.conf and the AOF are all it has
    down = node_status(valkey_cluster.nodes[1].to_dict())
    assert (down["up"], down["slots"], down["keys"]) == (False, None, None)
    valkey_cluster.start_node(1)
    assert valkey_cluster.form(timeout_s=20) is False  # no slot assigned again
    assert own_slots(valkey_cluster.client(1)) == [THIRDS[1]]
    assert valkey_cluster.client(1).get("{c}:kept") == b"1"
    up = node_status(valkey_cluster.nodes[1].to_dict())
    assert {k: up[k] for k in ("name", "up", "slots", "keys", "slot_ranges", "cluster_state")} == {
        "name": "valkey-1",
        "up": True,
        "slots": 5461,
        "keys": 1,
        "slot_ranges": ["5462-10922"],
        "cluster_state": "ok",
    }
    # then all nodes stopped and started on new ports (one recorded port was taken, say)
    valkey_cluster.stop()
    ports = free_ports(6, {n.port for n in valkey_cluster.nodes})
    for i, node in enumerate(valkey_cluster.nodes):  # nodes.conf names the old ports
        node.port, node.bus_port = ports[i], ports[3 + i]
        valkey_cluster.start_node(i)
    assert valkey_cluster.form(timeout_s=20) is False  # MEET updates the addresses
    assert [own_slots(valkey_cluster.client(i)) for i in range(3)] == [[r] for r in THIRDS]
    rc = RedisCluster.from_url(valkey_cluster.url)
    try:
        assert rc.get("{c}:kept") == b"1"
    finally:
        rc.close()


def test_forming_with_a_node_down_names_it(tmp_path):
    cluster = ValkeyCluster(tmp_path / "c", shards=2)
    cluster.start_node(0)
    try:
        with pytest.raises(ClusterError, match=f"^valkey-1 on port {cluster.nodes[1].port}: "):
            form(cluster.nodes, timeout_s=0.3)
    finally:
        cluster.stop()
