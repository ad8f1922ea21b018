"""The worker's emitter on a real Valkey: a write fenced out by another worker's claim."""

from __future__ import annotations

import logging

from kvrelay.core.keys import MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import PrefillTask, TokenChunk
from kvrelay.pipeline.queue.progress import new_progress
from kvrelay.pipeline.queue.streams import Streams
from kvrelay.workers.emitter import Emitter, Inflight, Outgoing, OutgoingKind
from tests.queue_state import set_cancelled

KEYS = Keys("emit:")


def test_fenced_out_write_logs_what_happened(r, caplog):
    s = Streams(r, KEYS, "w1")
    s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    task = PrefillTask(request_id="q2", prompt_token_ids=[1, 2], sampling={})
    r.hset(KEYS.progress, "q2", new_progress())
    r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    [entry] = s.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    s.admit([(entry.entry_id, "q2", 0, {})])
    r.hset(KEYS.consumers, "w1", 0)  # w1 stopped beating: w2 claims its entry
    w2 = Streams(r, KEYS, "w2")
    w2.claim(KEYS.prefill_stream, PREFILL_GROUP, 10_000, 10)
    w2.admit([(entry.entry_id, "q2", 0, {})])  # w1 is fenced out
    inflight = Inflight()
    inflight.add("q2", entry.entry_id)
    emitter = Emitter(s, KEYS.prefill_stream, PREFILL_GROUP, inflight)
    emitter.thread.start()
    chunk = TokenChunk(0, [5, 6], text="hi")
    with caplog.at_level(logging.WARNING, logger="kvrelay.workers.emitter"):
        emitter.put(Outgoing(OutgoingKind.EMIT, "q2", entry.entry_id, chunk))
        emitter.close()
    assert emitter.lost.get_nowait() == "q2" and len(inflight) == 0
    assert caplog.messages == [
        f"request q2: write refused (not-owner: entry {entry.entry_id} is no longer ours; "
        "chunk at token 0); dropping it"
    ]


def _held(r, s: Streams, rid: str) -> str:
    task = PrefillTask(request_id=rid, prompt_token_ids=[1, 2], sampling={})
    r.hset(KEYS.progress, rid, new_progress())
    r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    [entry] = s.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    s.admit([(entry.entry_id, rid, 0, {})])
    return entry.entry_id


def test_two_steps_of_one_request_in_one_batch_go_in_order(r):
    s = Streams(r, KEYS, "w3")
    s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    eid = _held(r, s, "q3")
    inflight = Inflight()
    inflight.add("q3", eid)
    emitter = Emitter(s, KEYS.prefill_stream, PREFILL_GROUP, inflight)
    for i in range(3):  # queued before the thread runs: one drain holds all three
        emitter.put(Outgoing(OutgoingKind.EMIT, "q3", eid, TokenChunk(i, [i])))
    r.config_resetstat()
    emitter.thread.start()
    emitter.close()
    assert emitter.lost.empty()
    assert r.info("commandstats")["cmdstat_evalsha"]["calls"] == 3  # one call per step of it
    assert s.emitted_tokens("q3") == ([0, 1, 2], 0, False)


def test_a_silent_emitter_reads_the_cancel_flags_of_what_it_holds(r):
    s = Streams(r, KEYS, "w4")
    s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    eid = _held(r, s, "q4")
    inflight = Inflight()
    inflight.add("q4", eid)
    emitter = Emitter(s, KEYS.prefill_stream, PREFILL_GROUP, inflight, check_s=0.05)
    set_cancelled(r, KEYS, "q4")
    emitter.thread.start()
    try:
        assert emitter.cancels.get(timeout=10) == "q4"
    finally:
        emitter.close()
