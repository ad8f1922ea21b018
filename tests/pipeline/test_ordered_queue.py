"""Ordered queueing (--scheduling-policy priority, lua/ordered.lua and lua/refill.lua): a request
goes straight to its stream only when nothing waits; otherwise it waits in the wait set and
workers move the best entries in as they have room: age-bound ones first, then lower priority
values, then tenants' start tags (weighted fair shares). Exact orders on a real Valkey."""

from __future__ import annotations

import time

from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.progress import new_progress
from kvrelay.pipeline.queue.streams import Streams

KEYS = Keys("oq:")
STREAM = KEYS.prefill_stream
SUBMIT = scripts.ordered("submit")
DAY_MS = 86_400_000


def submit(r, rid: str, priority: int = 0, tenant: str = "", cost: float = 100.0,
           age_ms: int = DAY_MS, bound: int = 0):  # fmt: skip
    keys = [KEYS.request(rid), STREAM, STREAM, KEYS.decode_stream, KEYS.progress]
    args = [100, rid.encode(), bound, PREFILL_GROUP, DECODE_GROUP, "s-" + rid, rid,
            new_progress(""), "1", "1", priority, tenant, repr(cost), age_ms,
            "status", "queued"]  # fmt: skip
    return r.eval(SUBMIT, len(keys), *keys, *args)


def streams(r, consumer: str = "w1") -> Streams:
    s = Streams(r, KEYS, consumer)
    s.ensure_group(STREAM, PREFILL_GROUP)
    return s


def read_all(s: Streams) -> list[str]:
    return [e.payload.decode() for e in s.read(STREAM, PREFILL_GROUP, 100, None)]


def test_straight_to_the_stream_only_when_nothing_waits(r):
    s = streams(r)
    assert submit(r, "a").startswith(b"1")  # an entry id: nothing waited
    assert submit(r, "b") == b"in-wait-set"  # a waits unread: b waits in the wait set
    assert [e[1][MESSAGE_FIELD] for e in r.xrange(STREAM)] == [b"a"]
    assert read_all(s) == ["a"]
    assert submit(r, "c") == b"in-wait-set"  # b still waits: c must not pass it
    assert s.refill(STREAM, PREFILL_GROUP, 5) == 2  # moved 2: 2 to read
    assert read_all(s) == ["b", "c"]
    assert submit(r, "d").startswith(b"1")  # all read, the wait set empty: straight in again
    assert not r.exists(STREAM + ":wait:m", STREAM + ":wait:bands", STREAM + ":wait:age")


def test_priorities_then_arrival(r):
    s = streams(r)
    submit(r, "first", priority=9)
    for rid, priority in (("p5a", 5), ("p0a", 0), ("p5b", 5), ("n1", -1), ("p0b", 0)):
        assert submit(r, rid, priority=priority) == b"in-wait-set"
    assert read_all(s) == ["first"]
    assert s.refill(STREAM, PREFILL_GROUP, 2) == 2  # room for two: the two best
    assert read_all(s) == ["n1", "p0a"]
    assert s.refill(STREAM, PREFILL_GROUP, 10) == 3
    assert read_all(s) == ["p0b", "p5a", "p5b"]
    assert s.refill(STREAM, PREFILL_GROUP, 10) == 0
    assert not r.exists(STREAM + ":wait:bands")


def test_refill_tops_up_to_the_room_counting_unread_entries(r):
    s = streams(r)
    for rid in ("a", "b", "c", "d"):
        submit(r, rid)
    assert s.refill(STREAM, PREFILL_GROUP, 3) == 3  # a is unread already: 2 more make 3
    assert r.hlen(STREAM + ":wait:m") == 1
    assert read_all(s) == ["a", "b", "c"]


def test_weighted_fair_shares_between_tenants(r):
    """Tenant A queues 6 requests before tenant B's 3; B (weight 2: half the cost per token)
    is served at twice A's rate from its first request on, not after A's backlog."""
    s = streams(r)
    submit(r, "a0", tenant="A", cost=100)  # straight in: A's finish tag 100
    for i in range(1, 6):
        submit(r, f"a{i}", tenant="A", cost=100)  # start tags 100 .. 500
    for i in range(3):
        submit(r, f"b{i}", tenant="B", cost=50)  # start tags 0, 50, 100 (ties: a < b)
    assert read_all(s) == ["a0"]
    s.refill(STREAM, PREFILL_GROUP, 20)
    assert read_all(s) == ["b0", "b1", "a1", "b2", "a2", "a3", "a4", "a5"]
    # an idle tenant does not bank credit: C's first start tag is the virtual time now
    submit(r, "c0", tenant="C", cost=10)
    submit(r, "a6", tenant="A", cost=100)
    assert read_all(s) == ["c0"]  # straight in: nothing waited
    assert float(r.hget(STREAM + ":wait:fin", "C")) == 510.0  # started at 500 (a5's tag)


def test_an_entry_past_its_age_bound_goes_before_any_priority(r):
    s = streams(r)
    submit(r, "head")
    submit(r, "old-low", priority=10, age_ms=1)
    submit(r, "high", priority=0)
    time.sleep(0.01)
    s.refill(STREAM, PREFILL_GROUP, 10)
    assert read_all(s) == ["head", "old-low", "high"]


def test_a_full_worker_takes_only_a_better_priority(r):
    """A full worker (`below`: the worst priority it holds) moves one better entry in and reads
    it with any unread ones; it reads nothing when neither is better."""
    s = streams(r)
    submit(r, "head", priority=5)  # straight in (unread)
    submit(r, "same", priority=5)
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=5) == 0  # nothing below 5 anywhere
    submit(r, "better", priority=1)
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=1) == 0
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=5) == 2  # better moved, head along
    assert read_all(s) == ["head", "better"]
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=5) == 0
    # an unread entry of a better priority (queued straight in) is read too
    assert s.refill(STREAM, PREFILL_GROUP, 1) == 1
    assert read_all(s) == ["same"]
    submit(r, "urgent", priority=0)
    assert [e[1][b"p"] for e in r.xrange(STREAM)][-1] == b"0"
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=5) == 1
    assert read_all(s) == ["urgent"]


def test_the_waiting_bound_counts_the_wait_set(r):
    streams(r)
    assert submit(r, "a", bound=3).startswith(b"1")
    assert submit(r, "b", bound=3) == b"in-wait-set"
    assert submit(r, "c", bound=3) == b"in-wait-set"
    assert submit(r, "d", bound=3) == 3  # a unread + b, c waiting: refused, nothing written
    assert not r.exists(KEYS.request("d")) and r.hlen(STREAM + ":wait:m") == 2


def test_a_full_worker_takes_another_tenant_than_the_one_crowding_it(r):
    s = streams(r)
    submit(r, "a0", tenant="A")  # start 0: straight in
    assert read_all(s) == ["a0"]
    submit(r, "a1", tenant="A")  # start 100: straight in, left unread (every worker is full)
    submit(r, "a2", tenant="A")  # start 200: waits
    submit(r, "b0", tenant="B", cost=1000)  # start 100 (the virtual time): waits, before a2
    # nothing crowds the worker (its tenants hold one slot each): nothing is worth taking
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=0) == 0
    # A crowds it: B's first is moved in and read, with the unread a1 before it
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=0, crowded="A") == 2
    assert read_all(s) == ["a1", "b0"]
    # A's next is not worth displacing for, nor is B's next before its turn (start 1100)
    submit(r, "b1", tenant="B")
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=0, crowded="A") == 0
    assert s.refill(STREAM, PREFILL_GROUP, 1) == 1
    assert read_all(s) == ["a2"]
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=0, crowded="B") == 0
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=0, crowded="A") == 1
    assert read_all(s) == ["b1"]
    # an unread entry of another tenant qualifies too (its tenant rides in field t)
    submit(r, "b2", tenant="B")
    assert [e[1][b"t"] for e in r.xrange(STREAM)][-1] == b"B"
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=0, crowded="B") == 0
    assert s.refill(STREAM, PREFILL_GROUP, 1, below=0, crowded="A") == 1
