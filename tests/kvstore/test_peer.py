"""The `Peer` protocol and the transport registry (`transport/peer.py`) as `Remote` uses them."""

from __future__ import annotations

import pytest

from kvrelay.kvstore import remote as remote_module
from kvrelay.kvstore.errors import AuthError, TransferError
from kvrelay.kvstore.remote import Remote
from kvrelay.kvstore.transport import Transport
from kvrelay.kvstore.transport import peer as peer_mod
from kvrelay.kvstore.transport.peer import Peer, connector, register_transport
from kvrelay.kvstore.transport.tcp import TcpServer
from tests.conftest import FakeClock


def test_the_registry_has_tcp_and_ucx_and_refuses_other_names():
    assert set(peer_mod.TRANSPORTS) == {Transport.TCP, Transport.UCX}
    assert connector("tcp") is peer_mod.TRANSPORTS[Transport.TCP]
    for name in (Transport.AUTO, "carrier-pigeon"):
        with pytest.raises(TransferError, match="no store-to-store transport"):
            connector(name)


def test_a_tcp_peer_from_the_registry_fetches_pages():
    pages = [memoryview(bytes([i]) * 64) for i in range(3)]

    def serve(req: dict):
        return {"ok": True, "found": 2}, pages[:2], lambda: None

    server = TcpServer("127.0.0.1", 0, b"s", serve, 5.0)
    try:
        peer: Peer = connector(Transport.TCP)(f"127.0.0.1:{server.port}", b"s", 5.0)
        dsts = [memoryview(bytearray(64)) for _ in range(3)]
        assert peer.fetch({"op": "fetch", "keys": [b"k"] * 3}, dsts, 5.0) == 2
        assert [bytes(d) for d in dsts[:2]] == [bytes(p) for p in pages[:2]]
        peer.close()
        peer.close()  # twice is fine
        with pytest.raises(AuthError):
            connector(Transport.TCP)(f"127.0.0.1:{server.port}", b"wrong", 5.0)
    finally:
        server.close()


class FakePeer:
    """A session whose fetches answer from a script: an int, or an exception to raise."""

    def __init__(self, script: list):
        self.script, self.closed = script, False

    def fetch(self, request: dict, dsts: list[memoryview], timeout_s: float) -> int:
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step

    def close(self) -> None:
        self.closed = True


def remote_for_transfers(clock: FakeClock) -> Remote:
    """A Remote in the middle of a fetch with 5 s left on `clock` (its clock from now on)."""
    clock.install(remote_module)
    remote = Remote(None, None, None, None, b"s", Transport.TCP, 5.0, None, False)  # type: ignore[arg-type]
    remote._tls.deadline = clock.monotonic() + 5
    return remote


def test_remote_opens_sessions_through_the_registry_and_replaces_a_stale_one_once(
    monkeypatch, fake_clock
):
    monkeypatch.setattr(peer_mod, "TRANSPORTS", dict(peer_mod.TRANSPORTS))
    opened: list[FakePeer] = []
    scripts = [[3, TransferError("broken pipe")], [2]]

    def connect(address: str, secret: bytes, timeout_s: float) -> FakePeer:
        assert (address, secret, timeout_s) == ("h:1", b"s", 5.0)  # the 5 s left of the fetch
        opened.append(FakePeer(scripts.pop(0)))
        return opened[-1]

    register_transport(Transport.TCP, connect)
    remote = remote_for_transfers(fake_clock)
    assert remote._transfer(Transport.TCP, "h:1", {}, []) == 3  # a new session, kept
    assert remote._transfer(Transport.TCP, "h:1", {}, []) == 2  # it broke: replaced once
    assert [p.closed for p in opened] == [True, False]
    assert remote._peers == {(Transport.TCP, "h:1"): [opened[1]]}
    remote.close()
    assert opened[1].closed and remote._peers == {}


def test_a_fresh_session_that_fails_is_not_retried(monkeypatch, fake_clock):
    monkeypatch.setattr(peer_mod, "TRANSPORTS", dict(peer_mod.TRANSPORTS))
    opened: list[FakePeer] = []

    def connect(address: str, secret: bytes, timeout_s: float) -> FakePeer:
        opened.append(FakePeer([TransferError("refused")]))
        return opened[-1]

    register_transport(Transport.TCP, connect)
    remote = remote_for_transfers(fake_clock)
    with pytest.raises(TransferError, match="refused"):
        remote._transfer(Transport.TCP, "h:1", {}, [])
    assert len(opened) == 1 and opened[0].closed and remote._peers == {}


def test_ucx_listener_sessions_are_reused_across_fetches(valkey, start_node, tmp_path):
    """Each fetch takes the cached UCX session (once, each fetch opened a new endpoint)."""
    from kvrelay.kvstore.client import StoreClient
    from tests.kvstore.conftest import SMALL, keys_for, payload
    from tests.kvstore.test_remote import SECRET, start_b, wait_published

    a = start_node(
        node_id="A",
        run_dir=str(tmp_path / "run-A"),
        redis_url=valkey.url,
        secret=SECRET,
        transport="ucx",
        ucx_port=0,
    )
    keys = keys_for(6)
    with StoreClient(a.config.run_dir, SMALL) as client:
        assert client.put(keys, [payload(SMALL, i) for i in range(6)]) == 6
    wait_published(valkey.url, keys[-1])
    b = start_b(start_node, valkey.url, "ucx-listener", run_dir=str(tmp_path / "run-B"))
    with StoreClient(b.config.run_dir, SMALL) as client:
        for i in range(3):  # three fetches, one page each
            assert len(client.get(keys[: i + 1])) == i + 1
        assert client.stats()["counters"]["bytes"]["remote/fetch_ucx"] == 3 * SMALL.page_bytes
    [server] = a.node._servers
    assert len(server.eps) == 1
    assert [len(s) for s in b.node.remote._peers.values()] == [1]
