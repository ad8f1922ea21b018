"""A store node with real clients: eviction order, corruption, restarts, processes, refusals."""

from __future__ import annotations

import multiprocessing as mp
import time
import zlib

import msgpack
import pytest
import redis
import zmq

from kvrelay.core.keys import Keys
from kvrelay.core.page_keys import holders
from kvrelay.kvstore.client import StoreClient
from kvrelay.kvstore.errors import IncompatiblePageError, StoreError
from kvrelay.kvstore.messages import Get, SlotsReply
from kvrelay.kvstore.page import HEADER_BYTES, PageSpec
from kvrelay.kvstore.server import arena_path
from tests.kvstore import procs
from tests.kvstore.conftest import FP, SMALL, keys_for, payload

SLOT = 4096  # a 1 KiB page plus its header rounds up to one 4 KiB slot
FILE = HEADER_BYTES + SMALL.page_bytes


def arena_for(n: int) -> int:
    return SLOT + n * SLOT


def hexes(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_demoted_pages_are_evicted_first(valkey, start_node, tmp_path):
    """Demote (a sliding-window group's pages behind the window) moves pages to the front of
    the arena's LRU: the next puts push them to disk before older pages."""
    node = start_node(arena_bytes=arena_for(4), disk_dir=str(tmp_path / "disk"),
                      disk_bytes=4 * FILE, redis_url=valkey.url)  # fmt: skip
    keys = keys_for(6)
    with StoreClient(node.config.run_dir, SMALL) as client:
        assert client.put(keys[:4], [payload(SMALL, i) for i in range(4)]) == 4
        assert client.demote([keys[2], keys[3], keys[5]], wait=True) == 2  # 5 is not there
        assert client.ls()["host"] == hexes([keys[2], keys[3], keys[0], keys[1]])
        client.demote([keys[1]])  # fire-and-forget, as the engine sends it
        wait_for(lambda: client.ls()["host"][0] == keys[1].hex())
        assert client.put(keys[4:5], [payload(SMALL, 4)]) == 1
        assert client.ls()["disk"] == hexes([keys[1]])
        assert client.get(keys[2:3]) == [payload(SMALL, 2).tobytes()]  # demoted, still there


def test_put_3n_demotes_then_drops_lru_in_order(valkey, start_node, tmp_path):
    node = start_node(
        arena_bytes=arena_for(4),
        disk_dir=str(tmp_path / "disk"),
        disk_bytes=4 * FILE,
        redis_url=valkey.url,
    )
    keys = keys_for(12)
    r = redis.Redis.from_url(valkey.url)
    with StoreClient(node.config.run_dir, SMALL) as client:
        for i, key in enumerate(keys):
            assert client.put([key], [payload(SMALL, i)]) == 1
            ls = client.ls()
            assert ls["host"] == hexes(keys[max(0, i - 3) : i + 1])
            assert ls["disk"] == hexes(keys[max(0, i - 7) : max(0, i - 3)])
        assert client.put(keys[9:10], [payload(SMALL, 9)]) == 0  # write-once
        assert client.get(keys[:1]) == []  # dropped: 0, 1, 2, 3 in that order
        assert client.get(keys[5:6]) == [payload(SMALL, 5).tobytes()]  # promoted from disk
        ls = client.ls()
        assert ls["host"] == hexes([keys[9], keys[10], keys[11], keys[5]])
        assert ls["disk"] == hexes([keys[6], keys[7], keys[8], keys[5]])  # 8 demoted, 4 dropped
        counters = client.stats()["counters"]
        assert counters["evictions"] == {"host/capacity": 9.0, "disk/capacity": 5.0}
        assert counters["hits"] == {"disk": 1.0}
        assert counters["puts"] == {"host": 12.0}

    def directory() -> dict[int, set]:
        return {i: holders(r.hget(Keys().pages, k.hex())) for i, k in enumerate(keys)}

    expected = {i: [] if i < 5 else ["n0"] for i in range(12)}  # gone pages leave it
    wait_for(lambda: directory() == expected)


def test_flipped_byte_on_disk_is_a_counted_miss(start_node, tmp_path):
    node = start_node(arena_bytes=arena_for(2), disk_dir=str(tmp_path / "disk"))
    keys = keys_for(3)
    with StoreClient(node.config.run_dir, SMALL) as client:
        client.put(keys, [payload(SMALL, i) for i in range(3)][:2])
        client.put(keys[2:], [payload(SMALL, 2)])  # demotes page 0 to disk
        path = node.node.store.disk._path(keys[0])
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 513] ^= 0x01
        path.write_bytes(data)
        assert client.get(keys) == []
        assert client.stats()["counters"]["corrupt_pages"] == {"disk": 1.0}
        assert not path.exists() and client.lookup(keys) == 0
        assert client.get(keys[1:]) == [payload(SMALL, i).tobytes() for i in (1, 2)]


def test_cross_process_and_restarts(start_node, tmp_path):
    settings = {
        "arena_bytes": arena_for(4),
        "disk_dir": str(tmp_path / "disk"),
        "disk_bytes": 8 * FILE,
    }
    node = start_node(**settings)
    run_dir = node.config.run_dir
    want = [zlib.crc32(payload(SMALL, i).tobytes()) for i in range(6)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:  # a worker process that puts, then exits (a worker restart)
        assert pool.apply(procs.put_pages, (run_dir, 4)) == 4
    with ctx.Pool(1) as pool:
        assert pool.apply(procs.read_crcs, (run_dir, 4)) == want[:4]
    with StoreClient(run_dir, SMALL) as client:
        client.put(keys_for(6)[4:], [payload(SMALL, i) for i in (4, 5)])  # 0, 1 go to disk
    node.stop()  # flushes the arena to disk; the arena file stays

    node = start_node(**settings)  # arena rebuilt from shared memory
    keeper = StoreClient(run_dir, SMALL)  # a worker that stays up while the node restarts
    keeper.connect()
    with StoreClient(run_dir, SMALL) as client:
        assert sorted(client.ls()["host"]) == sorted(hexes(keys_for(6)[2:]))  # slot order
        assert [zlib.crc32(p) for p in client.get(keys_for(6)[2:])] == want[2:]
    node.stop()
    arena_path(node.config).unlink()  # as after a reboot: only the disk tier is left

    node = start_node(**settings)
    assert keeper.get(keys_for(6)[:1]) == [payload(SMALL, 0).tobytes()]  # remapped new arena
    keeper.close()
    with StoreClient(run_dir, SMALL) as client:
        assert client.ls()["host"] == [keys_for(6)[0].hex()]
        got = client.get(keys_for(6)[:4]) + client.get(keys_for(6)[4:])
        assert [zlib.crc32(p) for p in got] == want
        assert client.stats()["counters"]["hits"] == {"disk": 6.0, "host": 1.0}


def test_four_processes_overlapping_keys(start_node):
    node = start_node(arena_bytes=arena_for(16))
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(procs.hammer, [(node.config.run_dir, s, 2.0) for s in range(4)])
    assert all(reads > 0 for _, reads, _ in results)
    assert [bad for _, _, bad in results] == [0, 0, 0, 0]
    with StoreClient(node.config.run_dir, SMALL) as client:
        stats = client.stats()
        assert stats["pages"]["pinned"] == 0
        assert stats["counters"]["puts"]["host"] == sum(p for p, _, _ in results)
        evicted = stats["counters"].get("evictions", {}).get("host/capacity", 0)
        assert evicted == stats["counters"]["puts"]["host"] - 16


def test_wrong_fingerprint_page_size_and_bad_requests_are_refused(start_node):
    node = start_node(fingerprint=FP)
    run_dir = node.config.run_dir
    other_model = PageSpec("e" * 32, "float32", 2, 4, 2, 8)
    with (
        StoreClient(run_dir, other_model) as client,
        pytest.raises(
            IncompatiblePageError,
            match="model fingerprint mismatch: this store "
            f"holds pages of '{FP}', request is for '{'e' * 32}'",
        ),
    ):
        client.connect()
    bigger = PageSpec(FP, "float32", 2, 8, 2, 8)
    with (
        StoreClient(run_dir, bigger) as client,
        pytest.raises(
            IncompatiblePageError, match="this store holds 1024-byte pages, request has 2048"
        ),
    ):
        client.put(keys_for(1), [bytes(2048)])
    with StoreClient(run_dir, SMALL) as client:
        with pytest.raises(StoreError, match="a page payload is 10 bytes, expected 1024"):
            client.put(keys_for(1), [b"x" * 10])
        with pytest.raises(StoreError, match="16-byte page keys"):
            client.request(Get(keys=[b"short"]), SlotsReply)
        assert client.put(keys_for(1), [payload(SMALL, 0)]) == 1  # still serving


def _raw(sock, body: bytes, wait_ms: int = 5000) -> dict | None:
    """Send one raw request; its decoded reply, None when none came within `wait_ms`."""
    sock.send_multipart([b"", body])
    if not sock.poll(wait_ms):
        return None
    return msgpack.unpackb(sock.recv_multipart()[-1])


@pytest.mark.parametrize(
    ("req", "error"),
    [
        ({"op": "nope"}, "unknown op 'nope'; known: ['abort', 'commit'"),
        ({"op": 7}, "unknown op 7"),
        ({}, "unknown op None"),  # missing op
        ({"op": "get", "keys": [b"short"]}, "keys must be a list of at most 4096 16-byte"),
        ({"op": "get", "keys": b"k" * 16}, "keys must be a list"),  # wrong type
        ({"op": "get", "keys": [b"k" * 16] * 4097}, "keys must be a list of at most 4096"),
        ({"op": "commit", "keys": [b"k" * 16], "slots": ["a"]}, "slots must be a list"),
        ({"op": "release", "slots": 3}, "slots must be a list of slot numbers"),
        ({"op": "get", "remote": "yes"}, "malformed get request: Expected `bool`"),
        ({"op": "ls", "limit": "many"}, "malformed ls request: Expected `int`"),
        ({"op": "evict", "tier": None}, "malformed evict request: Expected `str`"),
        ({"op": "hello", "fp": 3}, "malformed hello request: Expected `str | null`"),
        ({"op": "commit", "keys": [b"k" * 16], "slots": []}, "commit needs one slot per key"),
        ({"op": "evict", "tier": "moon"}, "tier"),
    ],
)
def test_malformed_requests_get_error_replies_and_the_node_keeps_serving(start_node, req, error):
    node = start_node(fingerprint=FP)
    with StoreClient(node.config.run_dir, SMALL) as client:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(client.url)
        try:
            reply = _raw(sock, msgpack.packb({"id": 41, **req}, use_bin_type=True))
            assert reply is not None
            assert reply["ok"] is False and reply["id"] == 41, reply
            assert error in reply["error"], reply
            assert reply["kind"] == "StoreError"
            # fire-and-forget: no reply, not even an error
            noreply = msgpack.packb({"id": 42, "noreply": True, **req}, use_bin_type=True)
            assert _raw(sock, noreply, wait_ms=200) is None
        finally:
            sock.close(0)
        assert client.put(keys_for(1), [payload(SMALL, 0)]) == 1  # still serving
        assert client.lookup(keys_for(1)) == 1


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"\xc1garbage", "malformed request"),  # not msgpack
        (msgpack.packb([1, 2]), "malformed request: Expected `object`, got `array`"),
        (msgpack.packb({"op": "get", "id": "x"}), "malformed get request: Expected `int`"),
        (b"", "malformed request"),
    ],
)
def test_undecodable_requests_get_an_error_without_an_id(start_node, body, error):
    node = start_node()
    with StoreClient(node.config.run_dir, SMALL) as client:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(client.url)
        try:
            reply = _raw(sock, body)
        finally:
            sock.close(0)
        assert reply is not None and reply["ok"] is False and reply["id"] is None
        assert reply["error"].startswith(error), reply
        assert client.put(keys_for(1), [payload(SMALL, 0)]) == 1  # still serving


def test_no_node_is_a_clear_error(tmp_path):
    with (
        StoreClient(tmp_path, SMALL, timeout_s=0.2) as client,
        pytest.raises(StoreError, match="did not answer 'hello' within 0.2s"),
    ):
        client.connect()
