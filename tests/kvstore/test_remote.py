"""Two store nodes: a page put on A is found through the Redis directory and pulled by B."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from kvrelay.core.keys import Keys
from kvrelay.core.page_keys import holders
from kvrelay.kvstore.client import StoreClient
from kvrelay.kvstore.config import StoreConfig
from kvrelay.kvstore.server import arena_path
from tests.kvstore.conftest import SMALL, keys_for, payload

SECRET = "correct horse"


def wait_published(redis_url: str, key: bytes, node_id: str = "A") -> None:
    """Directory writes are batched in the background; wait until `key` is listed."""
    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 5
    while node_id not in holders(r.hget(Keys().pages, key.hex())):
        assert time.monotonic() < deadline, "page never reached the directory"
        time.sleep(0.02)


class NodeProcess:
    """`kvrelay store` in a child process (node A), so it can be killed or frozen."""

    def __init__(
        self,
        tmp_path: Path,
        redis_url: str,
        node_id: str = "A",
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ):
        """`args`: more `kvrelay store` flags; `env`: more environment; `prefix`: what runs
        the node (`ip netns exec NS`)."""
        self.config = StoreConfig(node_id=node_id, run_dir=str(tmp_path / f"run-{node_id}"))
        env = {
            **os.environ,
            "KVRELAY_STORE_SECRET": SECRET,
            "KVRELAY_STORE_ARENA_BYTES": "65536",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "kvrelay.cli.main",
                "--log-level",
                "WARNING",
                "store",
                "--node-id",
                node_id,
                "--run-dir",
                self.config.run_dir,
                "--redis-url",
                redis_url,
                "--page-bytes",
                str(SMALL.page_bytes),
                "--fingerprint",
                SMALL.fingerprint,
                *args,
            ],
            env=env,
        )
        # A short timeout only to probe the starting node; requests then wait as a worker's do
        # (the default, above the node's own bound on a remote fetch, transfer_timeout_s): a
        # `get` that goes to a peer takes its UCX connect and handshake, which a loaded host
        # stretched past the probe's 0.5 s (StoreUnavailableError in test_netns).
        with StoreClient(self.config.run_dir, SMALL, timeout_s=0.5) as probe:
            deadline = time.monotonic() + 30
            while True:
                try:
                    probe.connect()
                    break
                except Exception:
                    assert self.proc.poll() is None, "store node exited"
                    assert time.monotonic() < deadline, "store node did not start"
                    time.sleep(0.05)
        self.client = StoreClient(self.config.run_dir, SMALL)

    def stop(self) -> None:
        self.client.close()
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                code = "no exit within 10 s"
        arena_path(self.config).unlink(missing_ok=True)
        assert code in (None, 0), f"store node exited with {code} on SIGTERM"


def start_b(start_node, redis_url: str, transport: str, **overrides):
    """Node B in this process; `ucx` uses same-host worker addresses, `ucx-listener` does not."""
    ucx = transport.startswith("ucx")
    settings = {
        "node_id": "B",
        "redis_url": redis_url,
        "secret": SECRET,
        "transport": "ucx" if ucx else "tcp",
        "ucx_port": 0 if ucx else -1,
        "ucx_same_host": transport == "ucx",
        **overrides,
    }
    return start_node(**settings)


@pytest.fixture
def node_a(valkey, tmp_path):
    node = NodeProcess(tmp_path, valkey.url)
    yield node
    node.stop()


@pytest.mark.parametrize("transport", ["tcp", "ucx", "ucx-listener"])
def test_page_put_on_a_is_fetched_by_b(valkey, node_a, start_node, transport):
    keys = keys_for(6)
    pages = [payload(SMALL, i) for i in range(6)]
    assert node_a.client.put(keys, pages) == 6
    wait_published(valkey.url, keys[-1])
    b = start_b(start_node, valkey.url, transport)
    r = redis.Redis.from_url(valkey.url)
    info = r.hgetall(Keys().store_node("A"))
    assert set(info) >= {b"tcp", b"ucx", b"pid", b"page_bytes", b"updated"}
    assert r.pttl(Keys().store_node("A")) > 0  # heartbeat with a TTL
    with StoreClient(b.config.run_dir, SMALL) as client:
        assert client.lookup(keys) == 6
        assert client.lookup(keys, remote=False) == 0
        assert client.get(keys[:3]) == [p.tobytes() for p in pages[:3]]
        assert client.get(keys) == [p.tobytes() for p in pages]  # 3 local, 3 remote
        assert client.lookup(keys, remote=False) == 6
        counters = client.stats()["counters"]
        assert counters["hits"] == {"remote": 6.0, "host": 3.0}
        via = {"tcp": "tcp", "ucx": "ucx_local", "ucx-listener": "ucx"}[transport]
        assert counters["bytes"][f"remote/fetch_{via}"] == 6 * SMALL.page_bytes
    assert node_a.client.stats()["counters"]["bytes"]["remote/serve"] == 6 * SMALL.page_bytes
    remote = b.node.remote  # the second fetch reused the first one's session
    idle = remote.local._idle if transport == "ucx" else remote._peers
    assert [len(sessions) for sessions in idle.values()] == [1]
    deadline = time.monotonic() + 5
    while holders(r.hget(Keys().pages, keys[5].hex())) != ["A", "B"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def fetch_failures(caplog) -> list[str]:
    """The warnings of node B's failed remote fetches."""
    return [r.getMessage() for r in caplog.records if r.name == "kvrelay.kvstore.remote"]


def ucx_loop_asleep(node: NodeProcess) -> dict[str, int]:
    """The node's `ucx_loop` counters, read once nothing is pinned and the loop sleeps in a wait."""
    looks = []
    deadline = time.monotonic() + 10
    while True:
        stats = node.client.stats()
        loop = stats["counters"]["ucx_loop"]
        looks.append(loop)
        # a wait begun and not ended: the loop sleeps (one that polls never does)
        if stats["pages"]["pinned"] == 0 and loop["wait"] > loop["event"] + loop["timeout"]:
            return loop
        assert time.monotonic() < deadline, f"the UCX loop never slept in a wait: {looks[-3:]}"
        time.sleep(0.02)


@pytest.mark.parametrize("transport", ["ucx", "ucx-listener"])
def test_an_idle_node_with_open_ucx_sessions_does_not_spin(valkey, node_a, start_node, transport):
    """Waiting UCX receives (the accept loop, a peer's open session) must not busy-poll."""
    keys = keys_for(2)
    assert node_a.client.put(keys, [payload(SMALL, i) for i in range(2)]) == 2
    wait_published(valkey.url, keys[-1])
    b = start_b(start_node, valkey.url, transport)
    with StoreClient(b.config.run_dir, SMALL) as client:
        assert len(client.get(keys)) == 2  # pulled from A over UCX; the session stays open
    # A's UCX loop counts its waits, how each ended (an event, its deadline) and its polls
    # that did not wait. A loop that polls (ucxx's `asyncio.sleep(0)` request wait) never
    # sleeps in a wait, so it fails to be found asleep before or after the idle window.
    before = ucx_loop_asleep(node_a)  # A has sent the pages (released them) and sleeps
    time.sleep(2.0)  # idle, with the sessions open
    after = ucx_loop_asleep(node_a)
    woke = {cause: after[cause] - before[cause] for cause in after}
    # No wait ran to its deadline: the loop's one timer, a session's idle limit (30 s), is not
    # due yet, so a loop that polls with short timed waits, or whose waits do not block, fails
    # here. Events may come: ucxx's notifier thread can post a last, empty notification late.
    assert woke["timeout"] == 0, woke


KILLED = {"tcp": "Connection refused", "ucx": "timed out", "ucx-listener": "UCX connect to"}


@pytest.mark.parametrize("transport", ["tcp", "ucx", "ucx-listener"])
def test_frozen_or_killed_peer_fails_cleanly_within_the_timeout(
    valkey, node_a, start_node, transport, caplog
):
    keys = keys_for(4)
    node_a.client.put(keys, [payload(SMALL, i) for i in range(4)])
    wait_published(valkey.url, keys[-1])
    # peer_retry_s 0: the killed A is tried again at once (not skipped after the timeout)
    b = start_b(start_node, valkey.url, transport, transfer_timeout_s=1.0, peer_retry_s=0.0)
    assert b.node.remote.timeout_s == 1.0  # the bound of one whole fetch
    with StoreClient(b.config.run_dir, SMALL) as client:
        node_a.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
        with caplog.at_level(logging.WARNING, logger="kvrelay.kvstore.remote"):
            assert client.get(keys[:2]) == []
        # the fetch ended because its time bound fired (a TransferTimeoutError), not otherwise
        [frozen] = fetch_failures(caplog)
        assert frozen.startswith("fetch of 2 pages from store node A failed: "), frozen
        assert "timed out" in frozen, frozen
        caplog.clear()
        node_a.proc.send_signal(signal.SIGKILL)
        node_a.proc.wait()
        with caplog.at_level(logging.WARNING, logger="kvrelay.kvstore.remote"):
            assert client.get(keys[2:]) == []
        # refused over TCP, a failed connect over the UCX listener; a same-host UCX peer's
        # death shows only as the time bound firing
        [killed] = fetch_failures(caplog)
        assert killed.startswith("fetch of 2 pages from store node A failed: "), killed
        assert KILLED[transport] in killed, killed
        assert client.stats()["counters"]["transfer_failures"] == {transport[:3]: 2.0}
        assert client.put(keys[:1], [payload(SMALL, 0)]) == 1  # B keeps serving


@pytest.mark.parametrize("transport", ["tcp", "ucx", "ucx-listener"])
def test_wrong_secret_is_refused(valkey, node_a, start_node, transport, caplog):
    keys = keys_for(2)
    node_a.client.put(keys, [payload(SMALL, i) for i in range(2)])
    wait_published(valkey.url, keys[-1])
    b = start_b(start_node, valkey.url, transport, secret="wrong")
    with StoreClient(b.config.run_dir, SMALL) as client:
        assert client.get(keys) == []
        assert client.stats()["counters"]["transfer_failures"] == {transport[:3]: 1.0}
    assert "peer failed the shared-secret challenge" in caplog.text


def test_local_requests_are_answered_while_a_remote_fetch_waits(valkey, node_a, start_node):
    keys = keys_for(3)
    node_a.client.put(keys[:2], [payload(SMALL, i) for i in range(2)])
    wait_published(valkey.url, keys[1])
    b = start_b(start_node, valkey.url, "tcp", transfer_timeout_s=2.0)
    fetched: list[list[bytes]] = []
    with (
        StoreClient(b.config.run_dir, SMALL) as fetcher,
        StoreClient(b.config.run_dir, SMALL) as local,
    ):
        assert local.put(keys[2:], [payload(SMALL, 2)]) == 1
        node_a.proc.send_signal(signal.SIGSTOP)  # the fetch below waits the full 2 s
        thread = threading.Thread(target=lambda: fetched.append(fetcher.get(keys[:2])))
        thread.start()
        time.sleep(0.3)  # let B start the fetch
        assert local.lookup(keys[2:], remote=False) == 1
        assert local.get(keys[2:]) == [payload(SMALL, 2).tobytes()]
        assert local.stats()["pages"]["host"] == 1
        assert thread.is_alive() and fetched == []  # answered while the fetch was pending
        thread.join(10)
        assert fetched == [[]]
        assert local.stats()["counters"]["transfer_failures"] == {"tcp": 1.0}


def test_a_second_worker_waits_for_a_fetch_of_the_same_pages(valkey, node_a, start_node):
    keys = keys_for(3)
    pages = [payload(SMALL, i).tobytes() for i in range(3)]
    node_a.client.put(keys, [payload(SMALL, i) for i in range(3)])
    wait_published(valkey.url, keys[-1])
    b = start_b(start_node, valkey.url, "tcp", transfer_timeout_s=2.0)
    got: list[list[bytes]] = []
    with (
        StoreClient(b.config.run_dir, SMALL) as first,
        StoreClient(b.config.run_dir, SMALL) as second,
    ):
        node_a.proc.send_signal(signal.SIGSTOP)  # hold the first fetch in flight
        thread = threading.Thread(target=lambda: got.append(first.get(keys)))
        thread.start()
        time.sleep(0.3)  # B has reserved the three slots and waits on A
        threading.Timer(0.3, node_a.proc.send_signal, (signal.SIGCONT,)).start()
        assert second.get(keys) == pages  # waited for the first fetch, no second transfer
        thread.join(10)
        assert got == [pages]
        counters = second.stats()["counters"]
        assert counters["bytes"]["remote/fetch_tcp"] == 3 * SMALL.page_bytes
        assert counters["hits"]["remote"] == 3.0
