"""A local Valkey Cluster of three primaries with a replica each (real valkey-server nodes),
formed as `kvrelay up --shards S --valkey-replicas N` forms it: a SIGKILLed primary's replica
promoted by the cluster, the killed node back as a replica, `form` again after roles swapped."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from kvrelay.cli.up.valkey import free_ports
from kvrelay.cli.up.valkey_cluster import (
    NODE_TIMEOUT_MS,
    cluster_info,
    form,
    make_nodes,
    myself,
    node_status,
    valkey_command,
)

pytestmark = pytest.mark.timeout(120)


class ReplicatedCluster:
    def __init__(self, data_dir: Path, shards: int = 3, replicas: int = 1):
        ports = free_ports(2 * shards * (1 + replicas), set())
        half = len(ports) // 2
        self.nodes = make_nodes(data_dir, ports[:half], ports[half:], None, replicas)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> None:
        node = next(n for n in self.nodes if n.name == name)
        Path(node.data_dir).mkdir(parents=True, exist_ok=True)
        cmd = valkey_command(node.port, node.data_dir, node.bus_port, NODE_TIMEOUT_MS)
        self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(timeout=10)

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(port=next(n.port for n in self.nodes if n.name == name))

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            proc.wait(timeout=10)


@pytest.fixture
def cluster(tmp_path: Path):
    c = ReplicatedCluster(tmp_path / "valkey-cluster")
    try:
        for node in c.nodes:
            c.start(node.name)
        yield c
    finally:
        c.stop()


def _role(c: ReplicatedCluster, name: str) -> str:
    client = c.client(name)
    try:
        me = myself(client)
        assert me is not None
        return "replica" if me.replica else "primary"
    finally:
        client.close()


def _wait(predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except redis.RedisError:
            pass
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_killed_primary_is_replaced_by_its_replica_and_rejoins_as_one(cluster):
    # three primaries: a failover needs the votes of a majority of them (two of two is not)
    names = [n.name for n in cluster.nodes]
    assert names == [
        "valkey-0",
        "valkey-1",
        "valkey-2",
        "valkey-0-replica-0",
        "valkey-1-replica-0",
        "valkey-2-replica-0",
    ]
    assert form(cluster.nodes, timeout_s=30) is True
    assert [_role(cluster, n) for n in names] == ["primary"] * 3 + ["replica"] * 3
    statuses = [node_status({"name": n.name, "port": n.port}) for n in cluster.nodes]
    ports = [n.port for n in cluster.nodes]
    assert [(s["role"], s["slots"], s.get("replica_of")) for s in statuses] == [
        ("primary", 5462, None),
        ("primary", 5461, None),
        ("primary", 5461, None),
        ("replica", 0, ports[0]),
        ("replica", 0, ports[1]),
        ("replica", 0, ports[2]),
    ]
    assert {cluster_info(cluster.client(n))["cluster_known_nodes"] for n in names} == {"6"}

    rc = RedisCluster(host="127.0.0.1", port=cluster.nodes[1].port)
    key = "{b}:k"  # slot 3300: node 0's range (0-5461)
    rc.set(key, "before")
    wait = cluster.client("valkey-0")
    assert wait.execute_command("WAIT", 1, 5000) == 1  # the replica holds it
    wait.close()

    cluster.kill("valkey-0")
    _wait(lambda: _role(cluster, "valkey-0-replica-0") == "primary")
    replica = cluster.client("valkey-0-replica-0")
    _wait(lambda: cluster_info(replica)["cluster_state"] == "ok")
    assert replica.get(key) == b"before"
    _wait(lambda: rc.set(key, "after"))  # redis-py follows the MOVED to the promoted node
    assert rc.get(key) == b"after"

    cluster.start("valkey-0")  # back from its nodes.conf: the newer epoch makes it a replica
    _wait(lambda: _role(cluster, "valkey-0") == "replica")
    old = cluster.client("valkey-0")
    _wait(lambda: old.info("replication")["master_link_status"] == "up")
    _wait(lambda: old.execute_command("READONLY") and old.get(key) == b"after")
    # `form` again (a restart of the stack) with swapped roles: no slots given, all ok
    assert form(cluster.nodes, timeout_s=30) is False
    roles = ["replica", "primary", "primary", "primary", "replica", "replica"]
    assert [_role(cluster, n) for n in names] == roles
    rc.close()
    old.close()
    replica.close()


def test_up_runs_a_replica_node_per_primary_started_before_the_rest(tmp_path):
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.up.command import build_programs

    first = free_ports(1, set())[0]
    argv = ["up", "--threads", "2", "--shards", "3", "--valkey-replicas", "1"]
    argv += ["--redis-port", str(first), "--cluster-node-timeout-ms", "1500"]
    programs, state = build_programs(build_parser().parse_args(argv), tmp_path)
    names = [p.name for p in programs]
    assert names[:6] == [
        "valkey-0",
        "valkey-1",
        "valkey-2",
        "valkey-0-replica-0",
        "valkey-1-replica-0",
        "valkey-2-replica-0",
    ]
    assert [p.autostart for p in programs] == [True] * 6 + [False] * (len(programs) - 6)
    nodes = state["cluster"]["nodes"]
    assert [n["port"] for n in nodes] == [first + i for i in range(6)]
    assert [n.get("replica_of") for n in nodes] == [None] * 3 + ["valkey-0", "valkey-1", "valkey-2"]
    assert [(n["first_slot"], n["last_slot"]) for n in nodes[3:]] == [
        (n["first_slot"], n["last_slot"]) for n in nodes[:3]
    ]
    assert nodes[3]["data_dir"] == str(tmp_path / "valkey-cluster" / "node-0-replica-0")
    assert (state["cluster"]["replicas"], state["cluster"]["node_timeout_ms"]) == (1, 1500)
    # a restart waits 2 * 1.5 + 1 s (the replica is promoted meanwhile); the first does not
    script = programs[3].command[2]
    assert programs[3].command[:2] == ["/bin/sh", "-c"]
    assert script.startswith(f"if [ -e {tmp_path}/valkey-cluster/node-0-replica-0/started ]; ")
    assert "then sleep 4; fi;" in script
    assert "--cluster-node-timeout 1500 --cluster-replica-validity-factor 0" in script


def test_a_run_dir_holding_a_cluster_wants_its_replica_count(tmp_path, capsys):
    from tests.cli.test_launch import _main

    run = tmp_path / "run"
    for name in ("node-0", "node-1", "node-2"):
        (run / "valkey-cluster" / name).mkdir(parents=True)
        (run / "valkey-cluster" / name / "nodes.conf").write_text("")
    want = (
        f"kvrelay up: error: {run / 'valkey-cluster'} holds a cluster with 0 replica(s) per "
        "primary: pass --valkey-replicas 0, or remove that directory for a fresh one"
    )
    argv = ["--shards", "3", "--valkey-replicas", "1"]
    assert _main(capsys, "up", "--detach", "--run-dir", str(run), *argv) == (2, want)
