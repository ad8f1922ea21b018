"""The step script refuses a step when the server's fence holds a step number below the
caller's last written one (`StepStatus.BEHIND`): a promoted replica or a restarted Valkey
lost the worker's last steps, and nothing is written until the worker repaired them
(`workers.emitter.Emitter.repair`)."""

from __future__ import annotations

from kvrelay.core.keys import PREFILL_GROUP
from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.queue.streams import StepStatus, StepWrite, WriteMode
from tests.pipeline.test_streams import KEYS, P, add_task, make, take


def test_a_step_after_lost_steps_is_refused_and_writes_nothing(r):
    a = make(r, "a")
    add_task(r, "b1")
    [eid] = take(a)
    flush = StepWrite(eid, "b1", TokenChunk(0, [7]), WriteMode.FLUSH)
    ok = a.s.step(P, PREFILL_GROUP, P, [flush], {}, 1, after=0)
    assert ok.status == StepStatus.OK and r.get(KEYS.fence("a")) == b"1"
    assert r.xlen(KEYS.out("b1")) == 1
    # the server lost steps 2 and 3 (its fence says 1): step 4, after 3, is refused
    late = StepWrite(eid, "b1", TokenChunk(3, [9]), WriteMode.FLUSH)
    behind = a.s.step(P, PREFILL_GROUP, P, [late], {}, 4, after=3)
    assert (behind.status, behind.num_control) == (StepStatus.BEHIND, 0)
    assert r.get(KEYS.fence("a")) == b"1" and r.xlen(KEYS.out("b1")) == 1
    # after 1 (what the server holds), or with no check, it goes
    assert a.s.step(P, PREFILL_GROUP, P, [late], {}, 4, after=1).status == StepStatus.OK
    assert r.get(KEYS.fence("a")) == b"4" and r.xlen(KEYS.out("b1")) == 2
    # a retried step the server holds is still a repeat, whatever `after` says
    again = a.s.step(P, PREFILL_GROUP, P, [late], {}, 4, after=4)
    assert again.status == StepStatus.REPEATED and r.xlen(KEYS.out("b1")) == 2
