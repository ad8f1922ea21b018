"""`kvrelay up --shards 3 --detach`: the whole stack on a local 3-node Valkey Cluster, `status`,
`down`, and an `up` again that finds its slots and keys (nodes.conf, AOF)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis
from redis.crc import key_slot

from kvrelay.core.keys import Keys
from tests.conftest import free_port
from tests.e2e.stack import kvrelay_up

pytestmark = pytest.mark.slow


def _kvrelay(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvrelay.cli.main", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_sharded_stack_runs_on_its_cluster_and_keeps_it_across_restarts(tmp_path):
    run, port = tmp_path / "run", free_port()
    flags = ["--shards", "3", "--prefill", "0", "--decode", "1", "--threads", "1"]
    flags += ["--kv-cache-bytes", str(96 << 20), "--arena-bytes", str(256 << 20)]
    try:
        done = kvrelay_up(run, port, *flags)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "kvrelay up: valkey cluster ok: 3 nodes, slots assigned\n" in done.stderr
        state = json.loads(done.stdout.strip().splitlines()[-1])
        nodes = state["cluster"]["nodes"]
        assert (state["shards"], [n["name"] for n in nodes]) == (
            3,
            ["valkey-0", "valkey-1", "valkey-2"],
        )
        assert state["redis_url"] == f"redis://127.0.0.1:{nodes[0]['port']}/0"
        # a hash tag per pipeline shard: shard i's keys on node i (the shared ones on node 0)
        keys = Keys(state["key_prefix"], shards=3)
        for node, shard in zip(nodes, keys.all(), strict=True):
            slot = key_slot(shard.decode_stream.encode())
            assert node["first_slot"] <= slot <= node["last_slot"]
            assert redis.Redis(port=node["port"]).exists(shard.decode_stream) == 1
        assert redis.Redis(port=nodes[0]["port"]).exists(Keys().models) == 1
        status = _kvrelay("status", "--run-dir", str(run), "--json")
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)["cluster"]
        assert [(n["name"], n["up"], n["slots"], n["cluster_state"]) for n in shown] == [
            ("valkey-0", True, 6128, "ok"),
            ("valkey-1", True, 8420, "ok"),
            ("valkey-2", True, 1836, "ok"),
        ]
        assert all(n["keys"] > 0 for n in shown)  # every node holds a shard
        down = _kvrelay("down", "--run-dir", str(run))
        assert down.stdout.startswith(f"stopped the stack in {run} (supervisord pid ")
        assert down.stdout.endswith(": valkey-0, valkey-1, valkey-2, store, ingress, decode-0\n")
        again = kvrelay_up(run, port, *flags)
        assert again.returncode == 0, again.stderr[-3000:]
        assert (
            "kvrelay up: valkey cluster ok: 3 nodes, slots kept from nodes.conf\n" in again.stderr
        )
        assert json.loads(again.stdout.strip().splitlines()[-1])["cluster"] == state["cluster"]
        assert redis.Redis(port=nodes[0]["port"]).exists(Keys().models) == 1  # the AOF
    finally:
        _kvrelay("down", "--run-dir", str(run))
