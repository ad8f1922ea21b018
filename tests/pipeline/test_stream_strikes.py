"""Poison versus churn on a real Valkey: strikes count only holders that died running an entry
without progress; released entries are claimable at once, never taken from another consumer."""

from __future__ import annotations

from kvrelay.core.keys import PREFILL_GROUP, Keys
from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.queue.progress import Progress, tail_entry
from kvrelay.pipeline.queue.streams import StepWrite
from tests.pipeline.test_streams import add_task, make

KEYS = Keys("t:")


def test_strikes_restart_with_progress_and_with_a_new_entry(r):
    s = make(r, "a")
    r.hset(KEYS.request("q"), mapping={"status": "decoding", "emitted": 0})
    # claimed again, nothing emitted since delivery 1, whose holder counts as running it
    assert s.strikes("q", "1-0", 2, 0) == 1
    r.hset(KEYS.request("q"), "emitted", 3)
    assert s.strikes("q", "1-0", 3, 0) == 0  # 3 new tokens: churn, not poison
    assert s.strikes("q", "1-0", 4, 0) == 0  # holder 3 never said it ran it
    assert s.ran("q", "1-0", 4)  # holder 4 begins running it (alone)
    assert s.strikes("q", "1-0", 5, 0) == 1
    assert s.strikes("q", "1-0", 6, 0) == 1  # holder 5 died before running it
    assert s.ran("q", "1-0", 7)  # ghost claims between ours (the delivery count jumps)
    assert s.strikes("q", "1-0", 9, 0) == 2
    rec = r.hmget(KEYS.request("q"), "claim_entry", "claim_emitted", "claim_delivery",
                  "claim_strikes", "claim_seen", "claim_ran")  # fmt: skip
    assert rec == [b"1-0", b"3", b"3", b"2", b"9", b"7"]
    # the hand-off's decode entry starts its own count from the tokens the task carried
    assert not s.ran("q", "2-0", 1)  # the record counts another entry: nothing recorded
    assert s.strikes("q", "2-0", 2, 3) == 1
    r.hset(KEYS.request("q"), "emitted", 4)
    assert s.strikes("q", "2-0", 3, 3) == 0
    # the live holder re-claiming its own entry (a late renewal) is no crash: count restarts
    assert s.ran("q", "2-0", 3)
    assert s.strikes("q", "2-0", 5, 3, alive=True) == 0
    assert s.ran("q", "2-0", 5)
    assert s.strikes("q", "2-0", 6, 3) == 1
    # no record to keep a count in: every redelivery is a strike (and nothing is recorded)
    assert s.strikes("gone", "1-0", 6, 0) == 5
    assert not s.ran("gone", "1-0", 6)
    assert not r.exists(KEYS.request("gone"))


def test_strikes_count_the_tail_of_the_progress(r):
    s = make(r, "a")
    r.hset(KEYS.request("q"), mapping={"status": "decoding", "emitted": 0})
    r.hset(KEYS.progress, "q", Progress(emitted=0, owner="w/1-0").encode())
    assert s.strikes("q", "1-0", 2, 0) == 1
    # a step of its owner w wrote a chunk of two tokens to the tail: the record and the
    # progress still say 0
    r.hset(KEYS.tail("w"), 1, tail_entry([("q", TokenChunk(0, [4, 5]).encode())]))
    assert s.strikes("q", "1-0", 3, 0) == 0


def test_release_makes_owned_entries_claimable_at_once(r):
    a, b = make(r, "a"), make(r, "b")
    e1, e2 = add_task(r, "r1"), add_task(r, "r2")
    a.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)  # a holds e1
    b.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)  # b holds e2
    b.beat(KEYS.worker("b"), {"name": "b"}, 10)
    a.release(KEYS.prefill_stream, PREFILL_GROUP, [(e1, "r1"), (e2, "r2")])  # e2: untouched
    got = b.claim(KEYS.prefill_stream, PREFILL_GROUP, 60_000, 10)
    assert [(e.entry_id, e.deliveries) for e in got] == [(e1, 2)]  # release counted no delivery
    assert {p["message_id"].decode(): p["consumer"].decode() for p in
            r.xpending_range(KEYS.prefill_stream, PREFILL_GROUP, "-", "+", 10)} == {
        e1: "b", e2: "b"}  # fmt: skip


def test_a_release_moves_the_tail_to_out_and_the_next_admission_goes_on_from_it(r):
    a, b = make(r, "a"), make(r, "b")
    e1 = add_task(r, "r1")
    [entry] = a.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    a.admit([(entry.entry_id, "r1", 0, {})])
    c0 = TokenChunk(0, [4, 5], text="hi")
    a.step(StepWrite(e1, "r1", c0))
    assert r.exists(KEYS.out("r1")) == 0  # in a's tail hash
    a.release(KEYS.prefill_stream, PREFILL_GROUP, [(e1, "r1")])
    # ownerless, so its tail is in out:{id} now, counted as history
    prog = Progress.parse(r.hget(KEYS.progress, "r1"))
    assert (prog.owner, prog.emitted, prog.hist) == ("", 2, 2)
    assert [c.token_ids for c in a.history("r1")] == [[4, 5]] and r.xlen(KEYS.out("r1")) == 1
    [claimed] = b.claim(KEYS.prefill_stream, PREFILL_GROUP, 60_000, 10)
    [found] = b.admit([(claimed.entry_id, "r1", 0, {})])
    assert found.emitted == 2 and r.xlen(KEYS.out("r1")) == 1  # nothing moved twice
