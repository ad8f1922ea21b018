"""Two store nodes in different network namespaces (as on two hosts), when we may create them.

Node A runs in a fresh namespace joined to ours by a veth pair; B stays here. Only the Redis
directory and the listeners' addresses connect them, as across hosts. Skipped (with the reason)
where `ip netns` is unavailable, for example without root.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import ValkeyServer
from tests.kvstore.conftest import SMALL, keys_for, payload
from tests.kvstore.test_remote import NodeProcess, wait_published


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def netns() -> tuple[str, str, str]:
    """(namespace, our address, its address) on a private veth link."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"kvt{tag}", f"kvh{tag}", f"kvn{tag}"
    octet = os.getpid() % 200 + 20
    ours, theirs = f"10.231.{octet}.1", f"10.231.{octet}.2"
    if _ip("netns", "add", ns, check=False).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{ours}/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "addr", "add", f"{theirs}/24", "dev", there)
        _ip("-n", ns, "link", "set", there, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, ours, theirs
    finally:
        _ip("link", "del", here, check=False)
        _ip("netns", "del", ns, check=False)


@pytest.mark.parametrize("transport", ["tcp", "ucx-listener"])
def test_fetch_across_network_namespaces(netns, tmp_path, transport):
    """Both nodes are child processes: each UCX context starts after the veth link exists (a
    process's UCX context lists the network interfaces once, when it is created)."""
    ns, ours, theirs = netns
    valkey = ValkeyServer(tmp_path / "valkey", extra_binds=(ours,))
    valkey.start()
    nodes: list[NodeProcess] = []
    try:
        a = NodeProcess(
            tmp_path,
            f"redis://{ours}:{valkey.port}/0",
            args=("--listen-host", theirs),
            prefix=("ip", "netns", "exec", ns),
        )
        nodes.append(a)
        keys = keys_for(5)
        assert a.client.put(keys, [payload(SMALL, i) for i in range(5)]) == 5
        wait_published(valkey.url, keys[-1])
        ucx = transport.startswith("ucx")
        b = NodeProcess(
            tmp_path,
            f"redis://127.0.0.1:{valkey.port}/0",
            node_id="B",
            args=(
                "--listen-host",
                ours,
                "--transport",
                "ucx" if ucx else "tcp",
                "--ucx-port",
                "0" if ucx else "-1",
            ),  # fmt: skip
            env={"KVRELAY_STORE_UCX_SAME_HOST": "false"},
        )
        nodes.append(b)
        assert b.client.get(keys) == [payload(SMALL, i).tobytes() for i in range(5)]
        assert b.client.stats()["counters"]["hits"] == {"remote": 5.0}
    finally:
        for node in reversed(nodes):
            node.stop()
        valkey.stop()
