"""`kvrelay up --shards 3 --valkey-replicas 1`: a local Valkey Cluster of 3 primaries with a
replica each. The primary holding a request's shard SIGKILLed mid-stream: the cluster promotes
its replica (cluster-node-timeout 2000 ms), the workers and the ingress follow the MOVED
redirects, the stream ends with the text of an undisturbed run, a new request is served, and
the killed node, restarted by supervisord, rejoins as a replica."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from functools import partial

import pytest
import redis

from kvrelay.cli.up.valkey_cluster import myself
from tests.e2e.chat_stream import openai_client, stream_killing
from tests.e2e.chat_stream import stream_text as chat_stream_text
from tests.e2e.stack import Stack

SAMPLING = {"max_tokens": 40, "temperature": 0}
NODES = [
    "valkey-0",
    "valkey-1",
    "valkey-2",
    "valkey-0-replica-0",
    "valkey-1-replica-0",
    "valkey-2-replica-0",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(
        tmp_path_factory.mktemp("run"),
        prefill=0,
        decode=1,
        shards=3,
        extra=["--valkey-replicas", "1"],
    )
    s.up()
    yield s
    s.down()


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)


stream_text = partial(chat_stream_text, sampling=SAMPLING)


def role(port: int) -> str | None:
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        me = myself(client)
        return None if me is None else ("replica" if me.replica else "primary")
    except redis.RedisError:
        return None
    finally:
        client.close()


def wait_for(ok, what: str, stack: Stack, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"{what}{stack.logs()}"
        time.sleep(0.2)


def test_a_killed_primary_of_a_cluster_is_replaced_by_its_replica_mid_stream(stack, client):
    ports = stack.cluster_nodes
    assert list(ports) == NODES
    assert [role(ports[n]) for n in NODES] == ["primary"] * 3 + ["replica"] * 3
    # `kvrelay status --json` shows each node's role
    cmd = [sys.executable, "-m", "kvrelay.cli.main", "status", "--run-dir", str(stack.run_dir)]
    done = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)["cluster"]
    assert [(n["name"], n["role"], n.get("replica_of")) for n in view] == [
        ("valkey-0", "primary", None),
        ("valkey-1", "primary", None),
        ("valkey-2", "primary", None),
        ("valkey-0-replica-0", "replica", ports["valkey-0"]),
        ("valkey-1-replica-0", "replica", ports["valkey-1"]),
        ("valkey-2-replica-0", "replica", ports["valkey-2"]),
    ]

    ref_text, ref_reason = stream_text(client, "cf-ref")
    assert ref_reason == "length"
    old = stack.valkey_of("cf-victim")
    assert old in NODES[:3]
    results, errors, killed = stream_killing(stream_text, client, stack, "cf-victim", old)
    assert killed, "the stream ended before its 8th token"
    assert not errors, f"{errors!r}{stack.logs()}"
    assert results == [(ref_text, "length")]
    # its replica serves the shard now (as every node that answers says, once gossiped)
    new = f"{old}-replica-0"
    wait_for(lambda: stack.valkey_of("cf-victim") == new, f"{new} serving", stack, 30)
    assert role(ports[new]) == "primary"
    # a new request after the failover completes, with the same text
    assert stream_text(client, "cf-after") == (ref_text, "length")
    # the killed node, restarted by supervisord (after 2 * 2 s + 1 s), is a replica now
    wait_for(lambda: role(ports[old]) == "replica", f"{old} a replica", stack, 60)
