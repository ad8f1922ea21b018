"""Two store nodes in different network namespaces (as on two hosts), when we may create them.

Node A runs in a fresh namespace joined to ours by a veth pair; B stays here. Only the Redis
directory and the listeners' addresses connect them, as across hosts. Skipped (with the reason)
where `ip netns` is unavailable, for example without root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from kvrelay.kvstore.client import StoreClient
from kvrelay.kvstore.config import StoreConfig
from kvrelay.kvstore.server import arena_path
from tests.conftest import ValkeyServer
from tests.kvstore.conftest import SMALL, keys_for, payload
from tests.kvstore.test_remote import SECRET, start_b, wait_published


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
def test_fetch_across_network_namespaces(netns, tmp_path, start_node, transport):
    ns, ours, theirs = netns
    valkey = ValkeyServer(tmp_path / "valkey", extra_binds=(ours,))
    valkey.start()
    cfg_a = StoreConfig(node_id="A", run_dir=str(tmp_path / "run-A"))
    proc = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            "-m",
            "kvrelay.cli.main",
            "--log-level",
            "WARNING",
            "store",
            "--node-id",
            "A",
            "--run-dir",
            cfg_a.run_dir,
            "--redis-url",
            f"redis://{ours}:{valkey.port}/0",
            "--page-bytes",
            str(SMALL.page_bytes),
            "--listen-host",
            theirs,
            "--secret",
            SECRET,
            "--arena-bytes",
            "65536",
        ]
    )
    try:
        client_a = StoreClient(cfg_a.run_dir, SMALL, timeout_s=0.5)
        deadline = time.monotonic() + 30
        while True:
            try:
                client_a.connect()
                break
            except Exception:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        keys = keys_for(5)
        assert client_a.put(keys, [payload(SMALL, i) for i in range(5)]) == 5
        client_a.close()
        wait_published(valkey.url, keys[-1])
        b = start_b(start_node, f"redis://127.0.0.1:{valkey.port}/0", transport, listen_host=ours)
        with StoreClient(b.config.run_dir, SMALL) as client:
            assert client.get(keys) == [payload(SMALL, i).tobytes() for i in range(5)]
            assert client.stats()["counters"]["hits"] == {"remote": 5.0}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        arena_path(cfg_a).unlink(missing_ok=True)
        valkey.stop()
