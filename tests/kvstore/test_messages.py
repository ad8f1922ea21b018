"""The store node protocol's Structs: round trips, and what a bad request is told."""

from __future__ import annotations

import msgpack
import pytest

from kvrelay.kvstore.errors import StoreError
from kvrelay.kvstore.messages import (
    OPS,
    Abort,
    BadRequest,
    Commit,
    Contains,
    Demote,
    Evict,
    Fetch,
    Get,
    Hello,
    Ls,
    Prefetch,
    Put,
    Release,
    Reply,
    Retain,
    SlotsReply,
    Stats,
    StatsReply,
    decode_fetch,
    decode_reply,
    decode_request,
    encode,
)

KEY = b"k" * 16


@pytest.mark.parametrize(
    "msg",
    [
        Hello(id=1, fp="f" * 32, page_bytes=1024),
        Put(id=2, keys=[KEY, KEY]),
        Commit(id=3, keys=[KEY], slots=[4]),
        Abort(id=4, keys=[KEY], slots=[4]),
        Get(id=5, keys=[KEY], remote=False),
        Release(id=6, slots=[1, 2], noreply=True),
        Contains(id=7, keys=[KEY]),
        Stats(id=8),
        Ls(id=9, limit=3),
        Evict(id=10, tier="all"),
        Demote(id=11, keys=[b"\x01" * 16]),
        Retain(id=12, keys=[KEY], session="chat-1", ttl_s=600.0),
        Prefetch(id=13, keys=[KEY], remote=True),
    ],
)
def test_every_request_round_trips_with_its_op_name(msg):
    body = encode(msg)
    assert msgpack.unpackb(body)["op"] == msg.__struct_config__.tag
    assert decode_request(body) == msg


def test_op_names_are_the_wire_names():
    assert (
        sorted(
            [
                "hello",
                "put",
                "commit",
                "abort",
                "get",
                "release",
                "contains",
                "stats",
                "ls",
                "evict",
                "demote",
                "retain",
                "prefetch",
            ]
        )
        == OPS
    )


def test_a_plain_map_request_decodes_and_unknown_fields_are_ignored():
    body = msgpack.packb({"op": "get", "id": 3, "keys": [KEY], "later": 1}, use_bin_type=True)
    assert decode_request(body) == Get(id=3, keys=[KEY])


def test_a_bad_request_keeps_its_id_and_noreply():
    body = msgpack.packb({"op": "release", "id": 9, "slots": "x", "noreply": True})
    with pytest.raises(BadRequest, match="slots must be a list of slot numbers") as info:
        decode_request(body)
    assert (info.value.req_id, info.value.noreply) == (9, True)


def test_an_error_reply_decodes_as_any_reply_type():
    body = encode(Reply(id=4, error="no", kind="PageFormatError"))
    for kind in (SlotsReply, StatsReply, Reply):
        reply = decode_reply(body, kind)
        assert (reply.id, reply.ok, reply.error, reply.kind) == (4, False, "no", "PageFormatError")
    with pytest.raises(StoreError, match="malformed reply"):
        decode_reply(b"\xc1", SlotsReply)


def test_stats_counters_keep_ints():
    reply = decode_reply(encode(StatsReply(ok=True, counters={"puts": {"host": 3}})), StatsReply)
    assert type(reply.counters["puts"]["host"]) is int


def test_peer_fetch_requests_are_checked():
    assert decode_fetch({"op": "fetch", "keys": [KEY], "fp": None, "page_bytes": 8}) == Fetch(
        keys=[KEY], page_bytes=8
    )
    with pytest.raises(StoreError, match="unknown transfer op 'get'"):
        decode_fetch({"op": "get", "keys": [KEY]})
    with pytest.raises(StoreError, match="unknown transfer op None"):
        decode_fetch({"keys": [KEY]})
    with pytest.raises(StoreError, match="16-byte page keys"):
        decode_fetch({"op": "fetch", "keys": [b"short"]})
    with pytest.raises(StoreError, match="malformed fetch request"):
        decode_fetch({"op": "fetch", "keys": [], "page_bytes": "big"})
