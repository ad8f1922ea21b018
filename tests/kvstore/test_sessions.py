"""Sessions in a store node: retained pages evicted last, kept on disk, released at their TTL,
saved across a restart; prefetch hints bring disk pages up; counters by reason."""

from __future__ import annotations

import time

import redis

from kvrelay.core.keys import Keys
from kvrelay.core.page_keys import PrefetchHint
from kvrelay.kvstore.client import StoreClient
from kvrelay.kvstore.retention import SessionRetention
from tests.kvstore.conftest import FP, SMALL, keys_for, payload
from tests.kvstore.test_node import FILE, arena_for, hexes, wait_for


def put_each(client: StoreClient, keys: list[bytes], first: int = 0) -> None:
    for i, key in enumerate(keys):
        assert client.put([key], [payload(SMALL, first + i)]) == 1


def test_retention_counts_holds_per_session():
    """A page two sessions hold stays held until both end; a later retain extends a TTL and
    never shortens it; the table round-trips through dump/load."""
    keys = keys_for(4)
    table = SessionRetention(max_ttl_s=100)
    assert table.retain("a", keys[:3], 10, now=0) == keys[:3]
    assert table.retain("b", keys[1:], 50, now=0) == keys[3:]  # 1, 2 were held already
    assert table.retain("a", keys[:1], 1, now=5) == []  # a's deadline stays 10
    assert table.retain("c", keys[:1], 1e9, now=0) == []  # cut to max_ttl_s: until 100
    assert table.sessions["c"].until == 100
    assert table.expire(now=10) == [] and sorted(table.sessions) == ["b", "c"]
    assert table.expire(now=50) == keys[1:]  # b's; key 0 is c's still
    assert table.expire(now=100) == [keys[0]]
    assert table.num_keys == 0 and len(table) == 0

    table.retain("a", keys[:2], 10, now=0)
    data = table.dump()
    again = SessionRetention(max_ttl_s=100)
    assert again.load_bytes(data, present=lambda k: k != keys[1], now=4) == 1
    assert list(again.sessions["a"].keys) == [keys[0]]
    assert again.sessions["a"].until == 10


def test_retained_pages_are_evicted_last_and_kept_on_disk(valkey, start_node, tmp_path):
    """Arena of 4, disk of 4: a session's 2 pages stay in the arena while 6 plain pages pass
    through it; the disk drops plain pages before them; counters say why pages went."""
    node = start_node(arena_bytes=arena_for(4), disk_dir=str(tmp_path / "disk"),
                      disk_bytes=4 * FILE, redis_url=valkey.url)  # fmt: skip
    keys = keys_for(10)
    with StoreClient(node.config.run_dir, SMALL) as client:
        put_each(client, keys[:4])
        assert client.retain(keys[:2] + keys_for(1, salt="absent"), "chat-1", 60, wait=True) == 2
        put_each(client, keys[4:], first=4)
        ls = client.ls()
        # plain pages LRU first, then the session's
        assert ls["host"] == hexes(keys[8:10] + keys[:2])
        assert ls["disk"] == hexes(keys[4:8])  # 2, 3 dropped first; the session's never here
        more = keys_for(2, salt="more")
        put_each(client, more, first=20)  # plain pages go first: 8 and 9
        assert client.ls()["disk"] == hexes(keys[6:10])
        client.retain(more, "chat-2", 60, wait=True)  # every arena page retained now
        put_each(client, keys_for(1, salt="z"), first=30)  # the least recent of them goes
        ls = client.ls()
        assert ls["host"] == hexes(keys_for(1, salt="z") + keys[1:2] + more)
        assert ls["disk"] == hexes([*keys[7:10], keys[0]])  # 6, plain, made room for it
        stats = client.stats()
        assert stats["pages"]["sessions"] == 2
        assert (stats["pages"]["retained_host"], stats["pages"]["retained_disk"]) == (3, 1)
        evictions = stats["counters"]["evictions"]
        assert evictions == {"host/capacity": 8.0, "host/retained": 1.0, "disk/capacity": 5.0}
        assert client.get(keys[:2]) == [payload(SMALL, i).tobytes() for i in range(2)]


def test_a_session_past_its_ttl_is_evicted_first(start_node, tmp_path):
    node = start_node(arena_bytes=arena_for(3), disk_dir=str(tmp_path / "disk"))
    keys = keys_for(4)
    with StoreClient(node.config.run_dir, SMALL) as client:
        put_each(client, keys[:3])
        client.retain(keys[2:3], "short", 0.2, wait=True)
        assert client.ls()["host"] == hexes(keys[:3])  # 0, 1 plain (LRU), then the session's
        time.sleep(1.3)  # the node looks at deadlines at most once a second, on a request
        client.stats()
        assert client.put(keys[:1], [payload(SMALL, 0)]) == 0  # a request: expiry runs
        assert client.ls()["host"] == hexes([keys[2], keys[0], keys[1]])
        put_each(client, keys[3:], first=3)
        assert client.ls()["disk"] == hexes(keys[2:3])
        stats = client.stats()
        assert stats["counters"]["evictions"] == {"host/expired": 1.0}
        assert stats["pages"]["sessions"] == 0


def test_sessions_survive_a_node_restart(start_node, tmp_path):
    """The node saves its session table beside the disk tier at stop; the next node retains the
    same pages (here on disk after the flush) with the same deadline."""
    disk = str(tmp_path / "disk")
    node = start_node(arena_bytes=arena_for(4), disk_dir=disk, disk_bytes=4 * FILE)
    keys = keys_for(8)
    with StoreClient(node.config.run_dir, SMALL) as client:
        put_each(client, keys[:2])
        client.retain(keys[:2], "agent-7", 3600, wait=True)
    until = node.node.store.retention.sessions["agent-7"].until
    node.stop()
    again = start_node(arena_bytes=arena_for(4), disk_dir=disk, disk_bytes=4 * FILE,
                       keep_arena=False)  # fmt: skip
    assert again.node.store.retention.sessions["agent-7"].until == until
    with StoreClient(again.config.run_dir, SMALL) as client:
        assert client.stats()["pages"]["sessions"] == 1
        put_each(client, keys[2:], first=2)  # 6 plain pages through arena and disk
        assert set(hexes(keys[:2])) <= set(client.ls()["disk"] + client.ls()["host"])
        assert client.get(keys[:2]) == [payload(SMALL, i).tobytes() for i in range(2)]


def test_a_prefetch_hint_brings_disk_pages_into_the_arena(valkey, start_node, tmp_path):
    node = start_node(arena_bytes=arena_for(4), disk_dir=str(tmp_path / "disk"),
                      redis_url=valkey.url, fingerprint=FP)  # fmt: skip
    keys = keys_for(3)
    r = redis.Redis.from_url(valkey.url)
    with StoreClient(node.config.run_dir, SMALL) as client:
        put_each(client, keys)
        assert client.evict("host") == 3
        assert client.ls()["host"] == []
        wait_for(
            lambda: node.node.prefetcher is not None and node.node.prefetcher.subscribed.is_set()
        )
        other = PrefetchHint("0" * 32, keys).encode()  # another model's: ignored
        r.publish(Keys().prefetch, b"not a hint")
        r.publish(Keys().prefetch, other)
        r.publish(Keys().prefetch, PrefetchHint(FP, [*keys[:2], keys_for(1, salt="x")[0]]).encode())
        wait_for(lambda: client.ls()["host"] == hexes(keys[:2]))
        assert client.get(keys) == [payload(SMALL, i).tobytes() for i in range(3)]
        counters = client.stats()["counters"]
        assert counters["prefetch_pages"] == {"disk": 2.0}
        assert counters["prefetch_hits"] == {"": 2.0}
        assert counters["hits"] == {"host": 2.0, "disk": 1.0}
        assert client.prefetch(keys_for(4)) == 3  # a direct request: all 3 there, the 4th not
