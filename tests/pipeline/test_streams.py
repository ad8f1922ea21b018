"""Fenced stream delivery on a real Valkey: ownership, index checks, claims, DLQ, leases."""

from __future__ import annotations

import time

from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import DecodeTask, PrefillTask, TokenChunk
from kvrelay.pipeline.queue.streams import Emission, FenceStatus, Streams

KEYS = Keys("t:")


def make(r, consumer: str) -> Streams:
    s = Streams(r, KEYS, consumer, out_ttl_s=50, req_ttl_s=100)
    s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    s.ensure_group(KEYS.decode_stream, DECODE_GROUP)
    return s


def add_task(r, request_id: str = "r1") -> str:
    task = PrefillTask(request_id=request_id, prompt_token_ids=[1, 2, 3], sampling={})
    return r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()}).decode()


def out_chunks(r, request_id: str) -> list[TokenChunk]:
    return [TokenChunk.decode(f[MESSAGE_FIELD]) for _, f in r.xrange(KEYS.out(request_id))]


def test_ensure_group_twice_and_read_entries_added_before_group(r):
    eid = add_task(r)
    a = make(r, "a")
    a.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)  # BUSYGROUP tolerated
    entries = a.read(KEYS.prefill_stream, PREFILL_GROUP, count=10, block_ms=None)
    assert [e.entry_id for e in entries] == [eid]
    assert PrefillTask.decode(entries[0].payload).prompt_token_ids == [1, 2, 3]
    assert a.read(KEYS.prefill_stream, PREFILL_GROUP, count=10, block_ms=None) == []


def test_emit_checks_index_and_final_acks_and_expires(r):
    a = make(r, "a")
    eid = add_task(r)
    a.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    em = Emission(KEYS.prefill_stream, PREFILL_GROUP, eid, "r1", TokenChunk(0, [5, 6], "ab"))
    res = a.emit(em)
    assert (res.status, res.emitted) == (FenceStatus.OK, 2)
    em.chunk = TokenChunk(1, [7])  # duplicate of an index already emitted
    res = a.emit(em)
    assert (res.status, res.emitted) == (FenceStatus.INDEX_MISMATCH, 2)
    em.chunk = TokenChunk(2, [7], "ç", finish_reason="stop", usage={"completion_tokens": 3})
    em.req_fields = {"status": "finished", "finish_reason": "stop"}
    assert a.emit(em).emitted == 3
    assert [(c.index, c.token_ids) for c in out_chunks(r, "r1")] == [(0, [5, 6]), (2, [7])]
    assert r.xpending(KEYS.prefill_stream, PREFILL_GROUP)["pending"] == 0
    assert 0 < r.ttl(KEYS.out("r1")) <= 50
    assert 50 < r.ttl(KEYS.request("r1")) <= 100
    req = r.hgetall(KEYS.request("r1"))
    assert req[b"status"] == b"finished" and req[b"completion_tokens"] == b"3"
    assert a.emitted_tokens("r1") == ([5, 6, 7], 3, True)


def test_stale_consumer_refused_after_claim(r):
    a, b = make(r, "a"), make(r, "b")
    eid = add_task(r)
    a.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    assert a.emit(Emission(KEYS.prefill_stream, PREFILL_GROUP, eid, "r1", TokenChunk(0, [9]))).ok
    time.sleep(0.06)
    cursor, claimed = b.claim(KEYS.prefill_stream, PREFILL_GROUP, 50, 10)
    assert [(e.entry_id, e.deliveries) for e in claimed] == [(eid, 2)]
    assert b.emitted_tokens("r1") == ([9], 0, False)
    # the stale owner can no longer emit, hand off, renew or dead-letter
    stale = a.emit(Emission(KEYS.prefill_stream, PREFILL_GROUP, eid, "r1", TokenChunk(1, [4])))
    assert stale.status == FenceStatus.NOT_OWNER
    task = DecodeTask(request_id="r1", prompt_token_ids=[1], sampling={}).encode()
    assert (
        a.handoff(KEYS.prefill_stream, PREFILL_GROUP, eid, KEYS.decode_stream, "r1", task).status
        == FenceStatus.NOT_OWNER
    )
    assert a.renew(KEYS.prefill_stream, PREFILL_GROUP, [eid]) == [eid]
    assert a.dead_letter(KEYS.prefill_stream, PREFILL_GROUP, eid, b"x", "bad") is None
    assert r.xlen(KEYS.decode_stream) == 0 and r.xlen(KEYS.dlq) == 0
    # the new owner continues exactly where the output stopped
    res = b.handoff(
        KEYS.prefill_stream,
        PREFILL_GROUP,
        eid,
        KEYS.decode_stream,
        "r1",
        task,
        chunk=TokenChunk(1, [4]),
        req_fields={"status": "decoding"},
    )
    assert res.status == FenceStatus.OK and res.new_entry_id
    assert [c.token_ids for c in out_chunks(r, "r1")] == [[9], [4]]
    assert r.xpending(KEYS.prefill_stream, PREFILL_GROUP)["pending"] == 0
    assert DecodeTask.decode(r.xrange(KEYS.decode_stream)[0][1][MESSAGE_FIELD]).request_id == "r1"
    assert r.hget(KEYS.request("r1"), "status") == b"decoding"


def test_handoff_index_mismatch_changes_nothing(r):
    a = make(r, "a")
    eid = add_task(r)
    a.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    r.hset(KEYS.request("r1"), "emitted", 1)
    res = a.handoff(
        KEYS.prefill_stream,
        PREFILL_GROUP,
        eid,
        KEYS.decode_stream,
        "r1",
        b"t",
        chunk=TokenChunk(0, [4]),
    )
    assert (res.status, res.emitted) == (FenceStatus.INDEX_MISMATCH, 1)
    assert r.xlen(KEYS.decode_stream) == 0
    assert r.xpending(KEYS.prefill_stream, PREFILL_GROUP)["pending"] == 1


def test_renew_resets_idle_so_claim_skips_live_entries(r):
    a, b = make(r, "a"), make(r, "b")
    eid = add_task(r)
    a.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    time.sleep(0.15)
    assert a.renew(KEYS.prefill_stream, PREFILL_GROUP, [eid]) == []
    assert b.claim(KEYS.prefill_stream, PREFILL_GROUP, 100, 10)[1] == []
    assert a.deliveries(KEYS.prefill_stream, PREFILL_GROUP, [eid]) == {eid: 1}


def test_dead_letter_records_reason_acks_and_finishes_output(r):
    a = make(r, "a")
    eid = r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: b"\xc1garbage"}).decode()
    [entry] = a.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    dlq_id = a.dead_letter(KEYS.prefill_stream, PREFILL_GROUP, eid, entry.payload, "bad payload")
    assert dlq_id is not None
    [(got_id, fields)] = r.xrange(KEYS.dlq)
    assert got_id.decode() == dlq_id
    assert fields[b"reason"] == b"bad payload" and fields[b"m"] == b"\xc1garbage"
    assert fields[b"id"].decode() == eid and fields[b"consumer"] == b"a"
    assert r.xpending(KEYS.prefill_stream, PREFILL_GROUP)["pending"] == 0
    # with a known request id the client gets a final error chunk
    eid2 = add_task(r, "r2")
    a.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    a.dead_letter(KEYS.prefill_stream, PREFILL_GROUP, eid2, b"p", "too many deliveries", "r2")
    [chunk] = out_chunks(r, "r2")
    assert (chunk.index, chunk.finish_reason, chunk.error) == (0, "error", "too many deliveries")
    assert r.hget(KEYS.request("r2"), "status") == b"failed"


def test_emit_many_pipelines_in_order_and_cancel_flags(r):
    a = make(r, "a")
    eids = [add_task(r, f"q{i}") for i in range(3)]
    a.read(KEYS.prefill_stream, PREFILL_GROUP, 3, None)
    ems = [
        Emission(KEYS.prefill_stream, PREFILL_GROUP, e, f"q{i}", TokenChunk(0, [i, i]))
        for i, e in enumerate(eids)
    ]
    ems.append(Emission(KEYS.prefill_stream, PREFILL_GROUP, eids[0], "q0", TokenChunk(2, [1])))
    assert [(x.status, x.emitted) for x in a.emit_many(ems)] == [(FenceStatus.OK, 2)] * 3 + [
        (FenceStatus.OK, 3)
    ]
    r.set(KEYS.cancel("q1"), 1)
    assert a.cancelled(["q0", "q1", "q2"]) == {"q1"}


def test_emit_many_sends_no_script_exists_and_reloads_a_flushed_script(r):
    a = make(r, "a")
    eid = add_task(r, "s1")
    a.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    em = Emission(KEYS.prefill_stream, PREFILL_GROUP, eid, "s1", TokenChunk(0, [4]))
    r.script_flush()  # as after a Valkey restart: NOSCRIPT, load, send again (once)
    r.config_resetstat()
    assert [(x.status, x.emitted) for x in a.emit_many([em, em])] == [
        (FenceStatus.OK, 1),
        (FenceStatus.INDEX_MISMATCH, 1),
    ]
    assert [c.token_ids for c in out_chunks(r, "s1")] == [[4]]
    stats = r.info("commandstats")
    assert "cmdstat_script|exists" not in stats
    em.chunk = TokenChunk(1, [5])
    r.script_flush()  # a single emission is sent without a pipeline: the same recovery
    assert a.emit(em).emitted == 2
    assert r.info("commandstats")["cmdstat_evalsha"]["calls"] == 6  # 2 NOSCRIPT + 2, 1 + 1
    assert [c.token_ids for c in out_chunks(r, "s1")] == [[4], [5]]


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
    time.sleep(0.05)
    assert b.prune_consumers(KEYS.prefill_stream, PREFILL_GROUP, idle_ms=20) == 1  # only "c"
    names = {c["name"] for c in r.xinfo_consumers(KEYS.prefill_stream, PREFILL_GROUP)}
    assert names == {b"a", b"b"}
