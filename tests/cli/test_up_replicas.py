"""`kvrelay up --valkey-replicas N`: the programs, config files and state of a primary with N
replicas and 3 Sentinels (written, not launched: tests/e2e/test_valkey_failover.py runs them),
and the flags it refuses."""

from __future__ import annotations

import json

import pytest

from kvrelay.cli.main import build_parser
from kvrelay.cli.up.valkey import cluster_mode, valkey_ports
from kvrelay.cli.up.valkey_sentinel import CONF, STARTED
from kvrelay.core.sentinel_url import parse_sentinel_url
from tests.cli.test_launch import HINT, _main
from tests.conftest import free_port


def _programs(tmp_path, *flags: str):
    from kvrelay.cli.up.command import build_programs

    argv = ["up", "--threads", "2", *flags]
    return build_programs(build_parser().parse_args(argv), tmp_path)


def test_replicas_run_a_primary_replicas_and_three_sentinels_from_config_files(tmp_path):
    first = free_port()
    programs, state = _programs(
        tmp_path, "--valkey-replicas", "2", "--redis-port", str(first),
        "--sentinel-down-after-ms", "700", "--sentinel-failover-timeout-ms", "4000",
    )  # fmt: skip
    names = [p.name for p in programs]
    assert names[:6] == [
        "valkey",
        "valkey-replica-1",
        "valkey-replica-2",
        "valkey-sentinel-0",
        "valkey-sentinel-1",
        "valkey-sentinel-2",
    ]
    assert [p.priority for p in programs[:6]] == [10, 10, 10, 11, 11, 11]
    found = state["sentinel"]
    ports = valkey_ports(state)
    assert ports["valkey"] == first and len(set(ports.values())) == 6
    assert state["redis_url"] == (
        "redis+sentinel://"
        + ",".join(f"127.0.0.1:{ports[f'valkey-sentinel-{i}']}" for i in range(3))
        + "/kvrelay/0"
    )
    assert parse_sentinel_url(state["redis_url"]).master == found["master"] == "kvrelay"
    assert (found["down_after_ms"], found["failover_timeout_ms"]) == (700, 4000)
    assert cluster_mode(state) is False  # clients need not probe
    # every process gets the Sentinel URL
    assert {p.env.get("KVRELAY_REDIS_URL") for p in programs[6:]} == {state["redis_url"]}
    primary = (tmp_path / "valkey" / CONF).read_text()
    assert f"port {first}\n" in primary and "appendonly yes\n" in primary
    assert "replicaof" not in primary
    replica = (tmp_path / "valkey-replica-2" / CONF).read_text()
    assert replica.endswith(f"replicaof 127.0.0.1 {first}\n")
    sentinel = (tmp_path / "valkey-sentinel-1" / CONF).read_text()
    assert f"sentinel monitor kvrelay 127.0.0.1 {first} 2\n" in sentinel
    assert "sentinel down-after-milliseconds kvrelay 700\n" in sentinel
    assert "sentinel failover-timeout kvrelay 4000\n" in sentinel
    # a data node waits before a restart (not before its first start): 2 * 0.7 + 1 s
    script = programs[1].command[2]
    assert programs[1].command[:2] == ["/bin/sh", "-c"]
    assert f"if [ -e {tmp_path / 'valkey-replica-1' / STARTED} ]; then sleep 2.4; fi" in script
    assert script.endswith(f"{tmp_path / 'valkey-replica-1' / CONF}")
    assert programs[3].command[1:] == [str(tmp_path / "valkey-sentinel-0" / CONF), "--sentinel"]


def test_a_new_up_keeps_the_primary_the_sentinels_named_last(tmp_path):
    _, state = _programs(tmp_path, "--valkey-replicas", "1")
    (tmp_path / "stack.json").write_text(json.dumps(state))
    replica_port = valkey_ports(state)["valkey-replica-1"]
    conf = tmp_path / "valkey-sentinel-0" / CONF
    # what a Sentinel's file says after a failover (it rewrites its monitor line)
    conf.write_text(
        conf.read_text().replace(
            f"monitor kvrelay 127.0.0.1 {valkey_ports(state)['valkey']} 2",
            f"monitor kvrelay 127.0.0.1 {replica_port} 2",
        )
    )
    (tmp_path / "valkey" / STARTED).write_text("")
    _, again = _programs(tmp_path, "--valkey-replicas", "1")
    ports = valkey_ports(again)
    assert "replicaof" not in (tmp_path / "valkey-replica-1" / CONF).read_text()
    assert (
        (tmp_path / "valkey" / CONF)
        .read_text()
        .endswith(f"replicaof 127.0.0.1 {ports['valkey-replica-1']}\n")
    )
    sentinel = (tmp_path / "valkey-sentinel-0" / CONF).read_text()
    assert f"monitor kvrelay 127.0.0.1 {ports['valkey-replica-1']} 2\n" in sentinel
    assert not (tmp_path / "valkey" / STARTED).exists()  # its first start does not wait


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--valkey-replicas", "1", "--shards", "2"],
            "kvrelay up: error: --valkey-replicas with --shards 2: a cluster promotes a replica "
            "only with the votes of most primaries, and one of two is not most: use --shards 3 "
            "or more",
        ),
        (
            ["--valkey-replicas", "1", "--redis-url", "redis://127.0.0.1:1/0"],
            "kvrelay up: error: --valkey-replicas starts an embedded Valkey: drop --redis-url",
        ),
        (
            ["--valkey-replicas", "17"],
            "kvrelay up: error: argument --valkey-replicas: replica count must be 0-16, got 17"
            + HINT,
        ),
        (
            ["--sentinel-down-after-ms", "5"],
            "kvrelay up: error: argument --sentinel-down-after-ms: value must be 100-600000, "
            "got 5" + HINT,
        ),
    ],
)
def test_bad_replica_flags_are_refused_before_launching(tmp_path, capsys, argv, message):
    code, line = _main(capsys, "up", "--detach", "--run-dir", str(tmp_path / "run"), *argv)
    assert (code, line) == (2, message)
    assert not (tmp_path / "run").exists()
