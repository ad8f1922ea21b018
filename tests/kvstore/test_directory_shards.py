"""The page directory over three shards (real Valkey): each page's entry in the `pages` hash of
its key's shard, found again by another node and by the ingress's router."""

from __future__ import annotations

import redis

from kvrelay.core.keys import Keys
from kvrelay.core.page_keys import holders
from kvrelay.kvstore.directory import Directory

PREFIX = "dirs:"
KEYS = Keys(PREFIX, shards=3)
PAGES = [bytes([0, 0, 0, i]) + b"\x11" * 28 for i in range(6)]  # shards 0, 1, 2, 0, 1, 2


def test_page_entries_spread_over_the_shards_and_are_found(valkey_session):
    a = Directory(valkey_session.url, PREFIX, "A", shards=3)
    b = Directory(valkey_session.url, PREFIX, "B", shards=3)
    r = redis.Redis.from_url(valkey_session.url)
    try:
        a.start({"host": "a"}, PAGES[:4])
        b.start({"host": "b"}, PAGES[2:])
        a._flush()
        b._flush()
        where = [[holders(r.hget(k.pages, p.hex())) for p in PAGES] for k in KEYS.all()]
        assert where == [
            [["A"], [], [], ["A", "B"], [], []],
            [[], ["A"], [], [], ["B"], []],
            [[], [], ["A", "B"], [], [], ["B"]],
        ]
        assert a.locate(PAGES) == [[], [], ["B"], ["B"], ["B"], ["B"]]
        assert b.locate(PAGES) == [["A"], ["A"], ["A"], ["A"], [], []]
        a.remove(PAGES[2:3])
        a._flush()
        assert b.locate(PAGES[2:3]) == [[]]
        assert holders(r.hget(KEYS.at(2).pages, PAGES[2].hex())) == ["B"]
    finally:
        a.stop()
        b.stop()
        r.close()
