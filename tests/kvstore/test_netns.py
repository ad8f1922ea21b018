"""Two store nodes in different network namespaces (as on two hosts), when we may create them.

Node A runs in a fresh namespace joined to ours by a veth pair (or, for the fault tests, by a
`tests.netlink.Link`: a user-space netem with delay, seeded loss and a cut); B stays here.
Only the Redis directory and the listeners' addresses connect them, as across hosts. Skipped
(with the reason) where `ip netns` or TUN devices are unavailable, for example without root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.conftest import ValkeyServer
from tests.kvstore.conftest import SMALL, keys_for, payload
from tests.kvstore.test_remote import NodeProcess, wait_published
from tests.netlink import Link, add_netns, del_netns, on_port, require_netns, tcp_ports


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


# -- faults on the store <-> store link -------------------------------------------------------
# Node A sits behind a `tests.netlink.Link` (a user-space netem: delay, seeded loss, a cut),
# so both A's page transfers to B and A's directory traffic to Valkey cross it.

NUM_PAGES = 24  # a fetch of ~25 KB: many segments, so a cut can fall in the middle of one


class LinkedNodes:
    """Valkey here, node A in a namespace behind `link`, node B here (child processes)."""

    def __init__(self, tmp_path, link: Link, transport: str, **b_env: str):
        self.link = link
        self.valkey = ValkeyServer(tmp_path / "valkey", extra_binds=(link.ours,))
        self.valkey.start()
        self.nodes: list[NodeProcess] = []
        try:
            self._start(tmp_path, transport, b_env)
        except BaseException:
            self.close()
            raise

    def _start(self, tmp_path, transport: str, b_env: dict[str, str]) -> None:
        link, arena = self.link, {"KVRELAY_STORE_ARENA_BYTES": str(1 << 20)}
        self.a = NodeProcess(
            tmp_path,
            f"redis://{link.ours}:{self.valkey.port}/0",
            args=("--listen-host", link.theirs),
            env=arena,
            prefix=("ip", "netns", "exec", link.ns),
        )
        self.nodes.append(self.a)
        self.keys = keys_for(NUM_PAGES + 2)
        self.pages = [payload(SMALL, i) for i in range(NUM_PAGES + 2)]
        assert self.a.client.put(self.keys, self.pages) == NUM_PAGES + 2
        wait_published(self.valkey.url, self.keys[-1])
        ucx = transport.startswith("ucx")
        self.b = NodeProcess(
            tmp_path,
            f"redis://127.0.0.1:{self.valkey.port}/0",
            node_id="B",
            args=(
                "--listen-host",
                link.ours,
                "--transport",
                "ucx" if ucx else "tcp",
                "--ucx-port",
                "0" if ucx else "-1",
            ),  # fmt: skip
            env={"KVRELAY_STORE_UCX_SAME_HOST": "false", **arena, **b_env},
        )
        self.nodes.append(self.b)
        self.a_port = int(self.a.client.stats()["addresses"][transport[:3]].rsplit(":", 1)[1])

    def bytes_of(self, lo: int, hi: int) -> list[bytes]:
        return [p.tobytes() for p in self.pages[lo:hi]]

    def counters(self) -> dict:
        return self.b.client.stats()["counters"]

    def close(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        self.valkey.stop()


@pytest.fixture
def link():
    require_netns()
    link = Link(tag="s", net=234)
    add_netns(link.ns)
    try:
        try:
            link.create()
        except OSError as exc:  # TUNSETIFF refused (no CAP_NET_ADMIN in a container)
            pytest.skip(f"cannot create TUN devices here: {exc}")
        yield link
    finally:
        link.destroy()
        del_netns(link.ns)


@pytest.mark.parametrize("transport", ["tcp", "ucx-listener"])
def test_fetch_across_a_delayed_lossy_link(link, tmp_path, transport):
    """200 ms each way and 5% loss between the nodes: the pages arrive whole and verified
    (B's bound on one fetch raised to 30 s: TCP over a 400 ms round trip with 5% loss moves
    tens of KB/s)."""
    nodes = LinkedNodes(tmp_path, link, transport, KVRELAY_STORE_TRANSFER_TIMEOUT_S="30")
    try:
        link.netem(delay_s=0.2, loss=0.05)
        t0 = time.monotonic()
        assert nodes.b.client.get(nodes.keys[:NUM_PAGES]) == nodes.bytes_of(0, NUM_PAGES)
        print(f"\n{transport}: {NUM_PAGES} pages through 200 ms + 5% loss in "
              f"{time.monotonic() - t0:.1f}s; {link.relayed} packets relayed, "
              f"{link.dropped} dropped")  # fmt: skip
        assert link.dropped >= 1  # seeded: the 4th packet after netem() is the first lost
        counters = nodes.counters()
        assert counters["hits"] == {"remote": float(NUM_PAGES)}
        assert "transfer_failures" not in counters
    finally:
        link.clear()
        nodes.close()


@pytest.mark.parametrize("transport", ["tcp", "ucx-listener"])
def test_link_cut_mid_fetch_is_given_up_then_skipped_until_it_heals(link, tmp_path, transport):
    """The link is cut after the first packets of a fetch have crossed: B gives the fetch up
    at its bound (2 s), skips A for `peer_retry_s` (3 s: a lookup counts none of A's pages, a
    fetch does not wait), and fetches from A again once the link is back."""
    nodes = LinkedNodes(
        tmp_path,
        link,
        transport,
        KVRELAY_STORE_TRANSFER_TIMEOUT_S="2",
        KVRELAY_STORE_PEER_RETRY_S="3",
    )
    b = nodes.b.client
    try:
        assert b.get(nodes.keys[:2]) == nodes.bytes_of(0, 2)  # a session to A is open
        # TCP: the request and the first segment of the answer cross, then nothing; UCX (its
        # data flows on ports of its own): any 2 packets other than A's Valkey traffic
        match = on_port(nodes.a_port)
        if transport != "tcp":
            valkey = on_port(nodes.valkey.port)
            match = lambda packet: tcp_ports(packet) is not None and not valkey(packet)  # noqa: E731
        link.cut_after(2, match)
        t0 = time.monotonic()
        assert b.get(nodes.keys[2 : 2 + NUM_PAGES]) == []
        given_up = time.monotonic()
        assert link.cut_at is not None, "the fetch ended before the cut"
        counters = nodes.counters()
        assert counters["transfer_failures"] == {transport[:3]: 1.0}
        assert counters["hits"].get("remote") == 2.0  # the first two pages only
        # skipped: not counted by a lookup, not waited for by a fetch
        assert b.lookup(nodes.keys[2 : 2 + NUM_PAGES]) == 0
        assert b.get(nodes.keys[2 : 2 + NUM_PAGES]) == []
        counters = nodes.counters()
        assert counters["transfer_failures"] == {transport[:3]: 1.0}
        assert counters["transfer_skips"] == {"A": 2.0}  # the lookup and the fetch
        print(f"\n{transport}: cut {link.cut_at - t0:.2f}s into the fetch; given up "
              f"{given_up - link.cut_at:.2f}s after the cut; skipped fetch answered in "
              f"{time.monotonic() - given_up:.2f}s")  # fmt: skip
        link.clear()
        deadline = time.monotonic() + 30
        while (got := b.get(nodes.keys[2 : 2 + NUM_PAGES])) == []:
            assert time.monotonic() < deadline, "A was never fetched from again"
            time.sleep(0.2)
        assert got == nodes.bytes_of(2, 2 + NUM_PAGES)
        counters = nodes.counters()
        assert counters["hits"]["remote"] == float(2 + NUM_PAGES)
        assert counters["transfer_failures"] == {transport[:3]: 1.0}
    finally:
        link.clear()
        nodes.close()
