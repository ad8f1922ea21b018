"""Stream delivery on a real Valkey, fenced per worker: claims fence the dead consumer, step
numbers, the control list, DLQ, leases."""

from __future__ import annotations

from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import DecodeTask, PrefillTask, TokenChunk, decode_chunks, frame
from kvrelay.pipeline.queue import choices_state
from kvrelay.pipeline.queue.progress import Progress, new_progress, tail_entry
from kvrelay.pipeline.queue.streams import StepStatus, StepWrite, Streams, WriteMode
from tests.queue_state import FeedListener, ValkeyClock, expires_at, feed_chunks

KEYS = Keys("t:")
P, D = KEYS.prefill_stream, KEYS.decode_stream


class Stepper:
    """What a worker keeps for its steps (the emitter's part): its Streams, the step number,
    the control items to ack and the feeds of what it admitted."""

    def __init__(self, r, consumer: str, register: bool = True):
        self.s = Streams(r, KEYS, consumer, out_ttl_s=50, req_ttl_s=100)
        self.s.ensure_group(P, PREFILL_GROUP)
        self.s.ensure_group(D, DECODE_GROUP)
        if register:  # the first beat registers the consumer in the fence hash
            self.s.beat(KEYS.worker(consumer), {"name": consumer}, 10)
        self.no = self.acked = 0
        self.feeds: dict[str, list[str]] = {}

    def __getattr__(self, name):
        return getattr(self.s, name)

    def admit(self, entries):
        found = self.s.admit(entries)
        for (_eid, rid, _q, _f), one in zip(entries, found, strict=True):
            self.feeds[rid] = one.feeds
        return found

    def step(self, *writes: StepWrite, repeat: bool = False, drop_steps=()):
        if not repeat:
            self.no += 1
        res = self.s.step(
            P, PREFILL_GROUP, D, list(writes), self.feeds, self.no, self.acked,
            drop_steps=drop_steps,
        )  # fmt: skip
        if res.status != StepStatus.FENCED:
            self.acked = res.num_control
            self.feeds.update(res.feeds)
        return res


def make(r, consumer: str, register: bool = True) -> Stepper:
    return Stepper(r, consumer, register)


def add_task(r, request_id: str = "r1", feed: str = "") -> str:
    task = PrefillTask(request_id=request_id, prompt_token_ids=[1, 2, 3], sampling={})
    r.hset(KEYS.progress, request_id, new_progress(feed))  # what the submit script writes
    return r.xadd(P, {MESSAGE_FIELD: task.encode()}).decode()


def take(s: Stepper, count: int = 1, fields=None) -> list[str]:
    """Read `count` entries and admit them (the reader thread's two steps)."""
    entries = s.read(P, PREFILL_GROUP, count, None)
    found = s.admit([(e.entry_id, f"{_rid(e)}", 0, fields or {}) for e in entries])
    assert all(not f.ended for f in found)
    return [e.entry_id for e in entries]


def _rid(entry) -> str:
    return PrefillTask.decode(entry.payload).request_id


def out_chunks(r, request_id: str) -> list[TokenChunk]:
    return [c for _, f in r.xrange(KEYS.out(request_id)) for c in decode_chunks(f[MESSAGE_FIELD])]


def step(s: Stepper, *writes: StepWrite, drop_steps=()):
    return s.step(*writes, drop_steps=drop_steps)


def entries_blob(eids) -> bytes:
    return tail_entry([(f"q{i}", TokenChunk(0, [i, i]).encode()) for i in range(len(eids))])


def test_ensure_group_twice_and_read_entries_added_before_group(r):
    eid = add_task(r)
    a = make(r, "a")
    a.ensure_group(P, PREFILL_GROUP)  # BUSYGROUP tolerated
    entries = a.read(P, PREFILL_GROUP, count=10, block_ms=None)
    assert [e.entry_id for e in entries] == [eid]
    assert PrefillTask.decode(entries[0].payload).prompt_token_ids == [1, 2, 3]
    assert a.read(P, PREFILL_GROUP, count=10, block_ms=None) == []


def test_step_keeps_a_tail_and_the_end_flushes_acks_and_expires(r):
    a = make(r, "a")
    [eid] = [add_task(r, feed="f1")]
    take(a, fields={"status": "prefilling"})
    assert Progress.parse(r.hget(KEYS.progress, "r1")).owner == f"a/{eid}"
    assert a.feeds == {"r1": ["f1"]}
    first = TokenChunk(0, [5, 6], "ab")
    assert step(a, StepWrite(eid, "r1", first)).status == StepStatus.OK
    assert r.exists(KEYS.out("r1")) == 0  # not flushed yet: the chunks wait in the tail
    prog = Progress.parse(r.hget(KEYS.progress, "r1"))
    assert (prog.emitted, prog.hist) == (0, 0)  # the progress moves only at flushes
    assert a.history("r1") == [first]
    assert a.emitted("r1") == 2
    # the tail is the step's field of a's tail hash (its chunks of every request), not prog's
    assert r.hkeys(KEYS.progress) == [b"r1"]
    assert r.hgetall(KEYS.tail("a")) == {b"1": tail_entry([("r1", first.encode())])}
    assert a.emitted_tokens("r1") == ([5, 6], 2, False)
    last = TokenChunk(2, [7], "ç", finish_reason="stop", usage={"completion_tokens": 3})
    fields = {"status": "finished", "finish_reason": "stop"}
    done = StepWrite(eid, "r1", last, WriteMode.DONE, req_fields=fields)
    done.history = frame(first.encode()) + frame(last.encode())
    with ValkeyClock(r) as clock:
        assert step(a, done).status == StepStatus.OK
    assert [(c.index, c.token_ids) for c in out_chunks(r, "r1")] == [(0, [5, 6]), (2, [7])]
    assert len(r.xrange(KEYS.out("r1"))) == 1  # one entry: the tail and the final chunk
    assert r.xpending(P, PREFILL_GROUP)["pending"] == 0
    assert r.hget(KEYS.progress, "r1") is None and r.hlen(KEYS.progress) == 0
    assert expires_at(r, KEYS.out("r1")) in clock.window(50)  # out_ttl_s, from the end
    assert expires_at(r, KEYS.request("r1")) in clock.window(100)  # req_ttl_s
    req = r.hgetall(KEYS.request("r1"))
    assert req[b"status"] == b"finished" and req[b"completion_tokens"] == b"3"
    assert req[b"emitted"] == b"3"
    assert a.emitted_tokens("r1") == ([5, 6, 7], 3, True)
    assert r.exists(KEYS.feed("f1")) == 0  # a channel (SPUBLISH): nothing is stored


def test_feeds_get_one_entry_per_step_for_all_requests(r):
    a = make(r, "a")
    listener = FeedListener(r, KEYS.feed("f1"))  # the reader subscribed to its feed
    eids = [add_task(r, f"q{i}", feed="f1") for i in range(3)]
    take(a, 3)
    step(a)  # (loads the script: a first EVALSHA would get NOSCRIPT, then SCRIPT LOAD)
    r.config_resetstat()
    res = step(a, *[StepWrite(e, f"q{i}", TokenChunk(0, [i, i])) for i, e in enumerate(eids)])
    assert res.status == StepStatus.OK
    # no per-sequence commands: the script, one SET of the fence, one HSET of the step's tail
    # field and one SPUBLISH (steps 1, 65, 129... also give the tail hash a day to live); the
    # control list is read only when items wait
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}
    assert calls == {"evalsha": 1, "set": 1, "hset": 1, "spublish": 1, "config|resetstat": 1}
    [blob] = r.hvals(KEYS.tail("a"))
    assert blob == entries_blob(eids)
    [message] = listener.messages()
    assert {rid: c.token_ids for rid, c in feed_chunks(message).items()} == {
        "q0": [0, 0],
        "q1": [1, 1],
        "q2": [2, 2],
    }


def test_flush_moves_the_tail_to_out(r):
    a = make(r, "a")
    eid = add_task(r)
    take(a)
    c0, c1, c2 = TokenChunk(0, [1]), TokenChunk(1, [2]), TokenChunk(2, [3])
    step(a, StepWrite(eid, "r1", c0))
    flush = StepWrite(eid, "r1", c1, WriteMode.FLUSH)
    flush.history = frame(c0.encode()) + frame(c1.encode())
    step(a, flush, drop_steps=[1])  # (the emitter drops step fields no tail needs)
    step(a, StepWrite(eid, "r1", c2))
    [(_, fields)] = r.xrange(KEYS.out("r1"))
    assert [c.token_ids for c in decode_chunks(fields[MESSAGE_FIELD])] == [[1], [2]]
    prog = Progress.parse(r.hget(KEYS.progress, "r1"))
    assert (prog.emitted, prog.hist) == (2, 2)
    assert r.hkeys(KEYS.progress) == [b"r1"] and r.hkeys(KEYS.tail("a")) == [b"3"]
    assert a.history("r1") == [c0, c1, c2]
    assert a.emitted_tokens("r1") == ([1, 2, 3], 0, False)


def test_a_fenced_consumers_step_is_refused_wholesale_and_the_claimant_resumes(r):
    a, b = make(r, "a"), make(r, "b")
    listener = FeedListener(r, KEYS.feed("f1"))
    eid = add_task(r, feed="f1")
    eid2 = add_task(r, "r2")
    take(a, 2)
    assert step(a, StepWrite(eid, "r1", TokenChunk(0, [9]))).status == StepStatus.OK
    r.hset(KEYS.consumers, "a", 0)  # a's last beat is long past the lease
    r.persist(KEYS.tail("a"))
    with ValkeyClock(r) as clock:
        claimed = b.claim(P, PREFILL_GROUP, 10_000, 1)  # room for one: a is fenced all the same
    assert [(e.entry_id, e.deliveries) for e in claimed] == [(eid, 2)]
    assert r.get(KEYS.fence("a")) == b"f"
    # a's tail hash stays a day, for the admissions that move its requests' tails
    assert expires_at(r, KEYS.tail("a")) in clock.window(86_400)
    [found] = b.admit([(eid, "r1", 0, {})])
    # the admission moved a's tail of it to out:{id}: b writes its own tail
    assert (found.emitted, found.cancelled, found.feeds) == (1, False, ["f1"])
    assert [c.token_ids for c in out_chunks(r, "r1")] == [[9]]
    assert b.emitted_tokens("r1") == ([9], 0, False)
    assert len(listener.messages()) == 1  # a's first step
    # the stale owner can no longer emit, hand off (not even a request not claimed yet) or
    # dead-letter; it beats no more either, so its other entries go at the next scan
    task = DecodeTask(request_id="r1", prompt_token_ids=[1], sampling={}).encode()
    handoff = StepWrite(eid, "r1", TokenChunk(1, [4]), WriteMode.HANDOFF, task)
    stale = step(a, StepWrite(eid2, "r2", TokenChunk(0, [5])), handoff)
    assert (stale.status, stale.cancelled, stale.feeds) == (StepStatus.FENCED, set(), {})
    assert step(a).status == StepStatus.FENCED
    assert a.dead_letter(P, PREFILL_GROUP, eid, b"x", "bad") is None
    assert r.xlen(D) == 0 and r.xlen(KEYS.dlq) == 0 and listener.messages() == []
    assert r.hkeys(KEYS.tail("a")) == [b"1"] and len(out_chunks(r, "r1")) == 1
    assert a.beat(KEYS.worker("a"), {"name": "a"}, 10) == (False, True)
    assert r.hget(KEYS.consumers, "a") == b"0"
    assert [e.entry_id for e in b.claim(P, PREFILL_GROUP, 10_000, 10)] == [eid2]
    # the new owner continues exactly where the output stopped
    handoff.req_fields = {"status": "decoding"}
    assert step(b, handoff).status == StepStatus.OK
    assert b.emitted_tokens("r1") == ([9, 4], 0, False)
    assert feed_chunks(listener.messages()[-1])["r1"].token_ids == [4]
    assert (
        r.xpending(
            P,
            PREFILL_GROUP,
        )["pending"]
        == 1
    )  # eid2, now b's
    assert DecodeTask.decode(r.xrange(D)[0][1][MESSAGE_FIELD]).request_id == "r1"
    assert r.hget(KEYS.request("r1"), "status") == b"decoding"
    prog = Progress.parse(r.hget(KEYS.progress, "r1"))
    assert (prog.owner, prog.emitted, prog.hist) == ("", 2, 2)  # waits for a decode worker


def test_a_retried_step_is_not_applied_twice(r):
    a = make(r, "a")
    listener = FeedListener(r, KEYS.feed("f1"))
    eid = add_task(r, feed="f1")
    take(a)
    c0, c1 = TokenChunk(0, [1]), TokenChunk(1, [2], finish_reason="stop")
    assert step(a, StepWrite(eid, "r1", c0)).status == StepStatus.OK
    done = StepWrite(eid, "r1", c1, WriteMode.DONE)
    done.history = frame(c0.encode()) + frame(c1.encode())
    assert step(a, done).status == StepStatus.OK
    # the reply was lost: the emitter sends the same step (same number) again
    assert a.step(done, repeat=True).status == StepStatus.REPEATED
    assert a.step(StepWrite(eid, "r1", c0), repeat=True).status == StepStatus.REPEATED
    assert len(r.xrange(KEYS.out("r1"))) == 1 and len(listener.messages()) == 2
    assert r.hkeys(KEYS.progress) == []
    assert a.emitted_tokens("r1") == ([1, 2], 0, True)
    assert r.get(KEYS.fence("a")) == b"2"
    # a consumer that never registered (no first beat) cannot step
    ghost = make(r, "ghost", register=False)
    assert ghost.step().status == StepStatus.FENCED


def test_cancel_and_attach_reach_the_owner_through_its_control_list(r):
    a = make(r, "a")
    eids = [add_task(r, f"q{i}") for i in range(3)]
    take(a, 3)
    assert choices_state.cancel_sync(r, KEYS, ["q1", "q9"]) == ["q1"]
    _value, _runs, _tail = r.register_script(_attach())(
        keys=[KEYS.progress, KEYS.out("q2")], args=["q2", "f7", 4, "0"]
    )
    assert r.lrange(KEYS.control("a"), 0, -1) == [b"cancel q1", b"feeds q2 f7"]
    res = step(a, StepWrite(eids[0], "q0", TokenChunk(0, [1])))
    assert (res.cancelled, res.feeds, res.num_control) == ({"q1"}, {"q2": ["f7"]}, 2)
    # a lost reply: the repeat brings the items again; the next step drops them
    again = a.step(StepWrite(eids[0], "q0", TokenChunk(0, [1])), repeat=True)
    assert (again.status, again.cancelled, again.num_control) == (StepStatus.REPEATED, {"q1"}, 2)
    listener = FeedListener(r, KEYS.feed("f7"))
    res = step(a, StepWrite(eids[2], "q2", TokenChunk(0, [3])))
    assert (res.cancelled, res.feeds, res.num_control) == (set(), {}, 0)
    assert r.llen(KEYS.control("a")) == 0
    assert feed_chunks(listener.messages()[-1])["q2"].token_ids == [3]
    # a request waiting in a stream has no owner: its flag is read at admission
    waiting = add_task(r, "w1")
    choices_state.cancel_sync(r, KEYS, ["w1"])
    assert r.llen(KEYS.control("a")) == 0
    assert a.admit([(waiting, "w1", 0, {})])[0].cancelled


def test_the_control_list_is_read_only_when_items_wait(r):
    a = make(r, "a")
    eids = [add_task(r, f"q{i}") for i in range(4)]
    take(a, 4)
    assert step(a).status == StepStatus.OK and r.get(KEYS.fence("a")) == b"1"

    def lranges() -> int:
        stats = r.info("commandstats")
        return stats["cmdstat_lrange"]["calls"] if "cmdstat_lrange" in stats else 0

    r.config_resetstat()
    step(a, StepWrite(eids[0], "q0", TokenChunk(0, [1])))
    assert lranges() == 0  # nothing waits: the list is not read
    choices_state.cancel_sync(r, KEYS, ["q1", "q2", "q3"])
    assert r.get(KEYS.fence("a")) == b"2!"  # one '!' however many items
    # at most 2 items per step: the first step gets two, the one that acks them the third
    res = a.s.step(P, PREFILL_GROUP, D, [], a.feeds, 3, 0, max_control=2)
    assert (res.cancelled, res.num_control, r.get(KEYS.fence("a"))) == ({"q1", "q2"}, 2, b"3")
    res = a.s.step(P, PREFILL_GROUP, D, [], a.feeds, 4, 2, max_control=2)
    assert (res.cancelled, res.num_control) == ({"q3"}, 1)
    res = a.s.step(P, PREFILL_GROUP, D, [], a.feeds, 5, 1, max_control=2)
    assert (res.cancelled, res.num_control, r.llen(KEYS.control("a"))) == (set(), 0, 0)
    r.config_resetstat()
    res = a.s.step(P, PREFILL_GROUP, D, [], a.feeds, 6, 0, max_control=2)
    assert (res.status, res.num_control, lranges()) == (StepStatus.OK, 0, 0)


def _attach() -> str:
    from kvrelay.pipeline.queue import scripts

    return scripts.with_progress("attach")


def test_claim_takes_only_dead_consumers_entries_and_forgets_them_once_empty(r):
    a, b = make(r, "a"), make(r, "b")
    add_task(r)
    take(a)
    b.beat(KEYS.worker("b"), {"name": "b"}, 10)
    a.beat(KEYS.worker("a"), {"name": "a"}, 10)
    r.config_resetstat()
    assert b.claim(P, PREFILL_GROUP, 10_000, 10) == []  # a beats: nothing read per entry
    stats = r.info("commandstats")
    assert "cmdstat_xpending" not in stats and "cmdstat_xclaim" not in stats
    r.hset(KEYS.consumers, "gone", 0)  # a dead consumer that owns nothing
    assert b.claim(P, PREFILL_GROUP, 10_000, 10) == []
    assert r.hexists(KEYS.consumers, "gone") == 0
    assert r.get(KEYS.fence("gone")) == b"f"


def test_a_dead_consumer_is_forgotten_only_once_neither_stage_holds_anything_of_it(r):
    """The consumers hash serves both stages: a prefill worker's scan fences a dead decode
    consumer but keeps it, so the decode workers' next scan claims its entry at once."""
    a, d = make(r, "a"), make(r, "d")
    task = DecodeTask(request_id="r1", prompt_token_ids=[1, 2, 3], sampling={})
    r.hset(KEYS.progress, "r1", new_progress())
    r.xadd(D, {MESSAGE_FIELD: task.encode()})
    [held] = a.read(D, DECODE_GROUP, 1, None)
    r.hset(KEYS.consumers, "a", 0)  # a's lease ran out
    assert d.claim(P, PREFILL_GROUP, 10_000, 10) == []  # the prefill scan: nothing of a there
    assert r.get(KEYS.fence("a")) == b"f" and r.hexists(KEYS.consumers, "a") == 1
    [claimed] = d.claim(D, DECODE_GROUP, 10_000, 10)
    assert claimed.entry_id == held.entry_id
    assert r.hexists(KEYS.consumers, "a") == 1  # d holds it now; a holds nothing
    assert d.claim(D, DECODE_GROUP, 10_000, 10) == [] and r.hexists(KEYS.consumers, "a") == 0


def test_release_makes_entries_claimable_at_once(r):
    a, b = make(r, "a"), make(r, "b")
    eid = add_task(r)
    take(a)
    a.beat(KEYS.worker("a"), {"name": "a"}, 10)
    a.release(P, PREFILL_GROUP, [(eid, "r1")])
    assert Progress.parse(r.hget(KEYS.progress, "r1")).owner == ""
    [entry] = b.claim(P, PREFILL_GROUP, 10_000, 10)
    assert (entry.entry_id, entry.deliveries) == (eid, 2)  # the release itself counts none
    assert r.get(KEYS.fence("a")) == b"0"  # the releaser lives on: not fenced


def test_dead_letter_records_reason_acks_and_finishes_output(r):
    a = make(r, "a")
    eid = r.xadd(P, {MESSAGE_FIELD: b"\xc1garbage"}).decode()
    [entry] = a.read(P, PREFILL_GROUP, 1, None)
    dlq_id = a.dead_letter(P, PREFILL_GROUP, eid, entry.payload, "bad payload")
    assert dlq_id is not None
    [(got_id, fields)] = r.xrange(KEYS.dlq)
    assert got_id.decode() == dlq_id
    assert fields[b"reason"] == b"bad payload" and fields[b"m"] == b"\xc1garbage"
    assert fields[b"id"].decode() == eid and fields[b"consumer"] == b"a"
    assert r.xpending(P, PREFILL_GROUP)["pending"] == 0
    # with a known request id the readers get a final error chunk after the tail
    listener = FeedListener(r, KEYS.feed("f2"))
    eid2 = add_task(r, "r2", feed="f2")
    take(a)
    step(a, StepWrite(eid2, "r2", TokenChunk(0, [8])))
    a.dead_letter(P, PREFILL_GROUP, eid2, b"p", "too many deliveries", "r2")
    chunks = out_chunks(r, "r2")
    assert [(c.index, c.finish_reason, c.error) for c in chunks] == [
        (0, None, None),
        (1, "error", "too many deliveries"),
    ]
    assert feed_chunks(listener.messages()[-1])["r2"].error == "too many deliveries"
    assert r.hget(KEYS.request("r2"), "status") == b"failed"
    assert r.hget(KEYS.request("r2"), "emitted") == b"1"
    assert r.hget(KEYS.progress, "r2") is None and r.hlen(KEYS.progress) == 0


def test_a_flushed_script_is_reloaded(r):
    a = make(r, "a")
    eid = add_task(r, "s1")
    take(a)
    r.script_flush()  # as after a Valkey restart: NOSCRIPT, load, send again (once)
    r.config_resetstat()
    assert step(a, StepWrite(eid, "s1", TokenChunk(0, [4]))).status == StepStatus.OK
    stats = r.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 2
    assert a.emitted_tokens("s1") == ([4], 0, False)


def test_trim_acked_keeps_pending_and_undelivered(r):
    a = make(r, "a")
    eids = [add_task(r, f"q{i}") for i in range(5)]
    a.read(KEYS.prefill_stream, PREFILL_GROUP, 3, None)
    r.xack(KEYS.prefill_stream, PREFILL_GROUP, eids[0], eids[2])
    assert a.trim_acked(KEYS.prefill_stream, PREFILL_GROUP) == 1  # only eids[0]
    assert [e.decode() for e, _ in r.xrange(KEYS.prefill_stream)] == eids[1:]


def test_prune_consumers_removes_idle_empty_ones(r):
    a, b = make(r, "a"), make(r, "b")
    add_task(r)
    a.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)  # "a" owns an entry
    b.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)  # "b" got nothing
    make(r, "c").read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    import time

    r.hset(KEYS.tail("c"), 1, b"")  # a step field "c" left behind
    time.sleep(0.05)
    with ValkeyClock(r) as clock:
        assert b.prune_consumers(KEYS.prefill_stream, PREFILL_GROUP, idle_ms=20) == 1  # "c"
    names = {c["name"] for c in r.xinfo_consumers(KEYS.prefill_stream, PREFILL_GROUP)}
    assert names == {b"a", b"b"}
    # its tail hash goes in a day (a request taken from it may not be admitted yet)
    assert expires_at(r, KEYS.tail("c")) in clock.window(86_400)


def test_a_consumer_that_never_beat_is_adopted_for_claims(r):
    a, b = make(r, "a", register=False), make(r, "b")
    add_task(r)
    a.read(P, PREFILL_GROUP, 1, None)  # read, then died before its first heartbeat
    b.beat(KEYS.worker("b"), {"name": "b", "consumer": "b"}, 10)
    assert b.claim(P, PREFILL_GROUP, 10_000, 10) == []
    b.prune_consumers(P, PREFILL_GROUP)
    assert [e.deliveries for e in b.claim(P, PREFILL_GROUP, 10_000, 10)] == [2]
