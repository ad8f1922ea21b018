"""`kvrelay up --shards N`: a local Valkey Cluster under supervisord, and `kvrelay status` of it."""

from __future__ import annotations

import json
import sys

import pytest
import redis

from kvrelay.cli.main import build_parser, main
from kvrelay.cli.up.launch import Program, Supervisor, render_config
from kvrelay.cli.up.valkey import embedded_valkey, start_cluster, valkey_ports
from kvrelay.cli.up.valkey_cluster import own_slots
from tests.cli.test_launch import HINT, _main
from tests.conftest import free_port


def test_shards_run_cluster_nodes_first_and_the_rest_once_it_is_ok(tmp_path):
    from kvrelay.cli.up.command import build_programs

    first = free_port()
    argv = ["up", "--threads", "2", "--shards", "3", "--redis-port", str(first)]
    programs, state = build_programs(build_parser().parse_args(argv), tmp_path)
    names = [p.name for p in programs]
    assert names == ["valkey-0", "valkey-1", "valkey-2", "store", "ingress", "decode-0"]
    assert [p.autostart for p in programs] == [True, True, True, False, False, False]
    nodes = state["cluster"]["nodes"]
    bus = [n["bus_port"] for n in nodes]
    assert len({first, first + 1, first + 2, *bus}) == 6  # six distinct ports
    assert nodes == [
        {
            "name": f"valkey-{i}",
            "port": first + i,
            "bus_port": bus[i],
            "data_dir": str(tmp_path / "valkey-cluster" / f"node-{i}"),
            "first_slot": slots[0],
            "last_slot": slots[1],
        }
        # node i holds the slot of pipeline shard i's hash tag (13685, 3153, 15410)
        for i, slots in enumerate([(8420, 14547), (0, 8419), (14548, 16383)])
    ]
    assert programs[3].env["KVRELAY_SHARDS"] == "3"  # every process runs the 3 shards
    assert state["shards"] == 3 and state["redis_url"] == f"redis://127.0.0.1:{first}/0"
    assert programs[1].command[1:] == [
        "--port", str(first + 1), "--bind", "127.0.0.1",
        "--dir", str(tmp_path / "valkey-cluster" / "node-1"),
        "--appendonly", "yes", "--save", "", "--protected-mode", "no",
        "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
        "--cluster-port", str(bus[1]),
    ]  # fmt: skip
    assert programs[3].env["KVRELAY_REDIS_URL"] == state["redis_url"]
    assert valkey_ports(state) == {f"valkey-{i}": first + i for i in range(3)}
    config = render_config(tmp_path, programs, nodaemon=False)
    assert config.count("autostart=false") == 3 and config.count("autostart=true") == 3
    plain, single = build_programs(build_parser().parse_args(["up", "--threads", "2"]), tmp_path)
    assert [p.name for p in plain][0] == "valkey" and single["shards"] == 1
    assert "cluster" not in single and all(p.autostart for p in plain)


SHARDS = "kvrelay up: error: argument --shards"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shards", "0"], f"{SHARDS}: shard count must be 1-16, got 0"),
        (["--shards", "17"], f"{SHARDS}: shard count must be 1-16, got 17"),
        (["--shards", "two"], f"{SHARDS}: not a shard count: 'two'"),
        (
            ["--shards", "3", "--redis-port", "65534"],
            "kvrelay up: error: --redis-port 65534 leaves no room for 3 nodes",
        ),
        (
            ["--shards", "3", "--redis-port", "7000", "--port", "7002"],
            "kvrelay up: error: --port and --redis-port + 2 are both 7002",
        ),
    ],
)  # fmt: skip
def test_bad_shards_are_refused_before_launching(tmp_path, capsys, argv, message):
    code, line = _main(capsys, "up", "--detach", "--run-dir", str(tmp_path / "run"), *argv)
    assert (code, line) == (2, message if "argument" not in message else message + HINT)
    assert not (tmp_path / "run").exists()


def test_a_run_dir_holding_a_cluster_wants_its_shard_count(tmp_path, capsys):
    run = tmp_path / "run"
    for i in range(3):
        (run / "valkey-cluster" / f"node-{i}").mkdir(parents=True)
        (run / "valkey-cluster" / f"node-{i}" / "nodes.conf").write_text("")
    want = (
        f"kvrelay up: error: {run / 'valkey-cluster'} holds a 3-node Valkey cluster: pass "
        "--shards 3, or remove that directory for a fresh one"
    )
    for argv in ([], ["--shards", "2"]):
        assert _main(capsys, "up", "--detach", "--run-dir", str(run), *argv) == (2, want)


def _cluster_stack(run_dir, shards: int) -> tuple[Supervisor, dict]:
    """A stack of the embedded cluster and one program started after it, written not started."""
    args = build_parser().parse_args(["up", "--shards", str(shards), "--port", str(free_port())])
    programs, url, state = embedded_valkey(args, run_dir)
    sleeper = Program("after", [sys.executable, "-c", "import time; time.sleep(600)"])
    sleeper.autostart = False
    state = dict(state, redis_url=url, key_prefix="kvrelay:", programs=["valkey-0", "after"])
    sup = Supervisor(run_dir)
    sup.write([*programs, sleeper], nodaemon=False, state=state)
    return sup, state


def test_a_supervised_cluster_forms_starts_the_rest_and_keeps_its_slots(tmp_path, capsys):
    run = tmp_path / "run"
    _first, earlier = _cluster_stack(run, 2)
    sup, state = _cluster_stack(run, 2)  # the next `up` in this run dir: the same ports
    assert state["cluster"] == earlier["cluster"]
    sup.start(detach=True)
    try:
        assert sup.status()["after"][0] == "STOPPED"  # waits for the cluster
        start_cluster(sup, state, timeout_s=30)
        assert capsys.readouterr().err == "kvrelay up: valkey cluster ok: 2 nodes, slots assigned\n"
        assert sup.wait_running(["after"], timeout=30)
        with sup.rpc() as rpc:  # both nodes stopped: only their nodes.conf is left
            for name in ("valkey-0", "valkey-1"):
                rpc.supervisor.stopProcess(name)
            for name in ("valkey-0", "valkey-1"):
                rpc.supervisor.startProcess(name, False)
        start_cluster(sup, state, timeout_s=30)
        assert capsys.readouterr().err == (
            "kvrelay up: valkey cluster ok: 2 nodes, slots kept from nodes.conf\n"
        )
        ports = [n["port"] for n in state["cluster"]["nodes"]]
        slots = [own_slots(redis.Redis(port=port)) for port in ports]
        assert slots == [[(8420, 16383)], [(0, 8419)]]  # node i: shard i's tag (13685, 3153)
        assert main(["status", "--run-dir", str(run), "--json"]) == 0
        nodes = json.loads(capsys.readouterr().out)["cluster"]
        assert nodes == [
            {
                "name": f"valkey-{i}", "host": "127.0.0.1", "port": ports[i], "up": True,
                "role": "primary", "slots": count, "keys": 0, "slot_ranges": [ranges],
                "cluster_state": "ok",
            }
            for i, (ranges, count) in enumerate([("8420-16383", 7964), ("0-8419", 8420)])
        ]  # fmt: skip
        with sup.rpc() as rpc:
            rpc.supervisor.stopProcess("valkey-1")
        assert main(["status", "--run-dir", str(run)]) == 1  # the Redis view fails: which node
        out, err = capsys.readouterr()
        assert out.splitlines() == [
            f"{'VALKEY NODE':<24}{'PORT':>6}{'SLOTS':>7}{'KEYS':>8}  {'RANGES':<24}STATE",
            f"{'valkey-0':<24}{ports[0]:>6}{7964:>7}{0:>8}  {'8420-16383':<24}up (ok)",
            f"{'valkey-1':<24}{ports[1]:>6}{'-':>7}{'-':>8}  {'-':<24}down",
        ]
        assert err.startswith(f"kvrelay status: error: Redis at {state['redis_url']} is not ")
    finally:
        assert sup.stop(timeout=30)


def test_shards_on_a_given_redis_start_no_node_and_reach_every_process(tmp_path):
    from kvrelay.cli.up.command import build_programs

    url = "redis://127.0.0.1:7001/0"
    argv = ["up", "--threads", "2", "--shards", "3", "--redis-url", url]
    programs, state = build_programs(build_parser().parse_args(argv), tmp_path)
    assert [p.name for p in programs] == ["store", "ingress", "decode-0"]
    assert {p.env["KVRELAY_SHARDS"] for p in programs} == {"3"}
    assert (state["shards"], state["redis_url"], "cluster" in state) == (3, url, False)
