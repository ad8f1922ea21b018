"""The worker's emitter on a real Valkey: fenced steps, repeated steps, the control list."""

from __future__ import annotations

import logging
import time

import redis

from kvrelay.core.keys import MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import PrefillTask, TokenChunk
from kvrelay.pipeline.queue.progress import new_progress
from kvrelay.pipeline.queue.streams import StepResult, Streams
from kvrelay.workers.emitter import Emitter, Inflight, Outgoing, OutgoingKind
from tests.queue_state import FeedListener, feed_chunks, set_cancelled

KEYS = Keys("emit:")


def _streams(r, consumer: str) -> Streams:
    s = Streams(r, KEYS, consumer)
    s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    s.beat(KEYS.worker(consumer), {"name": consumer}, 10)  # registers the consumer
    return s


def _held(r, s: Streams, rid: str, feed: str = "") -> str:
    task = PrefillTask(request_id=rid, prompt_token_ids=[1, 2], sampling={})
    r.hset(KEYS.progress, rid, new_progress(feed))
    r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    [entry] = s.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    s.admit([(entry.entry_id, rid, 0, {})])
    return entry.entry_id


def test_a_fenced_step_writes_nothing_and_the_worker_is_told(r, caplog):
    s = _streams(r, "w1")
    eid = _held(r, s, "q1")
    eid2 = _held(r, s, "q2")
    r.hset(KEYS.consumers, "w1", 0)  # w1 stopped beating: w2 claims its entries
    w2 = _streams(r, "w2")
    assert len(w2.claim(KEYS.prefill_stream, PREFILL_GROUP, 10_000, 1)) == 1
    inflight = Inflight()
    inflight.add("q1", eid)
    inflight.add("q2", eid2)
    fenced: list[str] = []
    emitter = Emitter(s, KEYS.prefill_stream, PREFILL_GROUP, inflight, on_fenced=fenced.append)
    emitter.thread.start()
    with caplog.at_level(logging.WARNING, logger="kvrelay.workers.emitter"):
        emitter.put(Outgoing(OutgoingKind.EMIT, "q1", eid, TokenChunk(0, [5, 6], text="hi")))
        emitter.put(Outgoing(OutgoingKind.EMIT, "q2", eid2, TokenChunk(0, [7], text="ho")))
        emitter.close()
    assert fenced == ["w1"]
    assert caplog.messages == [
        "consumer w1 was fenced (its entries were claimed): dropping 2 requests and 2 writes; "
        "rejoining as a new consumer"
    ]
    assert s.history("q1") == [] and s.history("q2") == []


class LostReply(Streams):
    """A Streams whose first step runs on the server but whose reply never arrives."""

    lost = 0

    def step(self, *args, **kwargs) -> StepResult:
        res = super().step(*args, **kwargs)
        if not self.lost:
            self.lost += 1
            raise redis.ConnectionError("reply lost")
        return res


def test_a_step_whose_reply_was_lost_is_sent_again_and_not_applied_twice(r):
    s = LostReply(r, KEYS, "w5")
    s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    s.beat(KEYS.worker("w5"), {"name": "w5"}, 10)
    listener = FeedListener(r, KEYS.feed("f5"))
    eid = _held(r, s, "q5", feed="f5")
    inflight = Inflight()
    inflight.add("q5", eid)
    emitter = Emitter(s, KEYS.prefill_stream, PREFILL_GROUP, inflight)
    emitter.follow("q5", ["f5"])
    last = TokenChunk(1, [2], finish_reason="stop")
    r.config_resetstat()
    emitter.thread.start()
    emitter.put(Outgoing(OutgoingKind.EMIT, "q5", eid, TokenChunk(0, [1])))
    deadline = time.monotonic() + 10
    while r.get(KEYS.fence("w5")) != b"1" and time.monotonic() < deadline:
        time.sleep(0.01)  # the first step written (its reply lost) and repeated
    emitter.put(Outgoing(OutgoingKind.EMIT, "q5", eid, last, done=True))
    emitter.close()
    assert s.lost == 1 and emitter.lost.empty() and len(inflight) == 0
    # three calls: the first step twice (its repeat wrote nothing), then the final one
    assert r.info("commandstats")["cmdstat_evalsha"]["calls"] == 3
    assert s.emitted_tokens("q5") == ([1, 2], 0, True)
    assert len(r.xrange(KEYS.out("q5"))) == 1
    assert [feed_chunks(m)["q5"].index for m in listener.messages()] == [0, 1]
    assert r.get(KEYS.fence("w5")) == b"2"


def test_steps_of_one_request_queued_together_go_as_one_write(r):
    s = _streams(r, "w3")
    eid = _held(r, s, "q3")
    inflight = Inflight()
    inflight.add("q3", eid)
    emitter = Emitter(s, KEYS.prefill_stream, PREFILL_GROUP, inflight)
    for i in range(3):  # queued before the thread runs: one drain holds all three
        emitter.put(Outgoing(OutgoingKind.EMIT, "q3", eid, TokenChunk(i, [i], text=f"t{i}")))
    r.config_resetstat()
    emitter.thread.start()
    emitter.close()
    assert emitter.lost.empty()
    assert r.info("commandstats")["cmdstat_evalsha"]["calls"] == 1  # the three in one call
    assert s.emitted_tokens("q3") == ([0, 1, 2], 6, False)
    assert s.history("q3") == [TokenChunk(0, [0, 1, 2], text="t0t1t2")]


def test_with_a_stream_interval_further_tokens_wait_and_go_with_the_end(r):
    s = _streams(r, "w7")
    listener = FeedListener(r, KEYS.feed("f7"))
    eid = _held(r, s, "q7", feed="f7")
    inflight = Inflight()
    inflight.add("q7", eid)
    # an interval far longer than the test: what goes out goes without waiting for it
    emitter = Emitter(s, KEYS.prefill_stream, PREFILL_GROUP, inflight, interval_s=600)
    emitter.follow("q7", ["f7"])
    emitter.thread.start()
    emitter.put(Outgoing(OutgoingKind.EMIT, "q7", eid, TokenChunk(0, [10], text="a")))
    first = _next_message(listener)  # a first token goes at once
    assert feed_chunks(first)["q7"] == TokenChunk(0, [10], text="a")
    for i in (1, 2, 3):  # three engine steps inside the interval: held
        emitter.put(Outgoing(OutgoingKind.EMIT, "q7", eid, TokenChunk(i, [10 + i], text="b")))
    assert listener.messages(wait_s=0.5) == []
    # the end goes at once, and what was held goes with it, in one chunk
    end = TokenChunk(4, [14], finish_reason="length", usage={"completion_tokens": 5})
    emitter.put(Outgoing(OutgoingKind.EMIT, "q7", eid, end, done=True))
    last = _next_message(listener)
    both = TokenChunk(1, [11, 12, 13, 14], text="bbb", finish_reason="length",
                      usage={"completion_tokens": 5})  # fmt: skip
    assert feed_chunks(last)["q7"] == both
    emitter.close()
    assert s.emitted_tokens("q7") == ([10, 11, 12, 13, 14], 4, True)
    assert s.history("q7") == [TokenChunk(0, [10], text="a"), both]
    assert listener.messages(wait_s=0.2) == []
    listener.close()


def _next_message(listener: FeedListener, wait_s: float = 10.0) -> bytes:
    """The next message on the listener's channels (fails after `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        message = listener.pubsub.get_message(timeout=0.1)
        if message is not None and message["type"] == "smessage":
            return message["data"]
    raise AssertionError("no feed message")


def test_a_silent_emitter_learns_cancels_and_feeds_from_its_control_list(r):
    s = _streams(r, "w4")
    eid = _held(r, s, "q4")
    eid6 = _held(r, s, "q6")
    inflight = Inflight()
    inflight.add("q4", eid)
    inflight.add("q6", eid6)
    emitter = Emitter(s, KEYS.prefill_stream, PREFILL_GROUP, inflight, check_s=0.05)
    set_cancelled(r, KEYS, "q4")
    assert r.lrange(KEYS.control("w4"), 0, -1) == [b"cancel q4"]
    emitter.thread.start()
    try:
        assert emitter.cancels.get(timeout=10) == "q4"
        # a reader attaching: its feed reaches the owner, whose next chunk goes there
        feed = s.r.register_script(_attach())
        listener = FeedListener(r, KEYS.feed("f6"))
        feed(keys=[KEYS.progress, KEYS.out("q6")], args=["q6", "f6", 4, "0"])
        # the step after the one that brought the item drops it from the list
        deadline = time.monotonic() + 10
        while r.llen(KEYS.control("w4")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.llen(KEYS.control("w4")) == 0
        emitter.put(Outgoing(OutgoingKind.EMIT, "q6", eid6, TokenChunk(0, [9])))
    finally:
        emitter.close()
    got = [feed_chunks(m).get("q6") for m in listener.messages()]
    assert [c.token_ids for c in got if c] == [[9]]
    assert s.history("q6") == [TokenChunk(0, [9])]


def _attach() -> str:
    from kvrelay.pipeline.queue import scripts

    return scripts.with_progress("attach")


def test_the_tail_hash_keeps_the_steps_that_tails_still_need(r):
    s = _streams(r, "w1")
    e1, e2 = _held(r, s, "q1"), _held(r, s, "q2")
    inflight = Inflight()
    inflight.add("q1", e1)
    inflight.add("q2", e2)
    emitter = Emitter(s, KEYS.prefill_stream, PREFILL_GROUP, inflight)

    def write(rid: str, eid: str, chunk: TokenChunk, **kw) -> list[int]:
        """One step (the thread's loop, called directly); the steps in w1's tail hash."""
        emitter._write_once([Outgoing(OutgoingKind.EMIT, rid, eid, chunk, **kw)])
        return sorted(int(k) for k in r.hkeys(KEYS.tail("w1")))

    flush = {"req_fields": {"status": "decoding"}}  # record fields go with a flush
    assert write("q1", e1, TokenChunk(0, [5])) == [1]
    assert write("q2", e2, TokenChunk(0, [6])) == [1, 2]
    assert write("q1", e1, TokenChunk(1, [7])) == [1, 2, 3]
    # q1's tail goes to out:{id}; q2's starts at step 2, so only step 1 goes
    assert write("q1", e1, TokenChunk(2, [8]), **flush) == [2, 3]
    assert [c.token_ids for c in s.history("q1")] == [[5], [7], [8]]
    assert [c.token_ids for c in s.history("q2")] == [[6]]
    # no tail left: every step field goes
    assert write("q2", e2, TokenChunk(1, [9]), **flush) == []
    assert [c.token_ids for c in s.history("q2")] == [[6], [9]]
    assert r.xlen(KEYS.out("q1")) == 1 and r.xlen(KEYS.out("q2")) == 1


def test_inflight_names_the_tenant_crowding_its_worst_priority():
    held = Inflight()
    assert held.crowding() is None
    held.add("a1", "1-0", priority=5, tenant="A")
    held.add("b1", "2-0", priority=5, tenant="B", weight=2.0)
    held.add("u1", "3-0", priority=0, tenant="U")
    assert held.crowding() == (5, "")  # one slot each: nobody crowds it
    held.add("b2", "4-0", priority=5, tenant="B", weight=2.0)
    assert held.crowding() == (5, "")  # B's 2 slots for weight 2 weigh as A's 1: A first seen
    held.add("a2", "5-0", priority=5, tenant="A")
    assert held.crowding() == (5, "A")  # A's 2 for weight 1 against B's 2 for weight 2
    held.remove("a2", "5-0")
    held.remove("a1")
    assert held.crowding() == (5, "B")
