"""A worker name's slot on its host (`kvrelay.workers.slot`): one process serves a name, a
standby takes the slot the moment the holder dies, and the taker claims its predecessors'
entries at once (`lua/claim.lua`'s dead consumers), not after the lease."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, Keys
from kvrelay.pipeline.queue.streams import Streams
from kvrelay.workers.slot import WorkerSlot, dead_predecessors, slot_path

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_slot_path_is_per_stack_and_name(tmp_path):
    a = slot_path("redis://h:1/0", "kvrelay:", "", "decode-0", str(tmp_path))
    assert a.parent == tmp_path and a.name.endswith("-decode-0.lock")
    assert a == slot_path("redis://h:1/0", "kvrelay:", "", "decode-0", str(tmp_path))
    assert a != slot_path("redis://h:2/0", "kvrelay:", "", "decode-0", str(tmp_path))
    assert a != slot_path("redis://h:1/0", "kvrelay:", "m2", "decode-0", str(tmp_path))
    assert a != slot_path("redis://h:1/0", "kvrelay:", "", "decode-1", str(tmp_path))


def test_a_standby_takes_the_slot_when_its_holder_is_killed(tmp_path):
    path = tmp_path / "slot.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        slot = WorkerSlot(path)
        assert not slot.try_acquire() and not slot.held
        got: list[bool] = []
        waiter = threading.Thread(target=lambda: got.append(slot.wait(threading.Event())))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not got  # the holder lives: the standby waits
        os.kill(holder.pid, signal.SIGKILL)
        waiter.join(30)
        assert got == [True] and slot.held and slot.holder() == os.getpid()
        assert not WorkerSlot(path).try_acquire()  # ours now
        slot.release()
        other = WorkerSlot(path)
        assert other.try_acquire()
        other.release()
    finally:
        holder.kill()
        holder.wait()


def test_a_stopped_standby_gives_up_waiting(tmp_path):
    path = tmp_path / "slot.lock"
    first = WorkerSlot(path)
    assert first.try_acquire()
    stop = threading.Event()
    stop.set()
    assert WorkerSlot(path).wait(stop) is False
    first.release()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_dead_predecessors_are_the_names_consumers_of_a_gone_process(r):
    keys = Keys("slot-test:")
    r.hset(keys.consumers, mapping={
        "w.123": 1, "w.456.1": 1, "w.789": 1, "wx.1": 1, "w.abc": 1, "w.x.5": 1, "other.1": 1,
    })  # fmt: skip
    here = socket.gethostname()
    # no record: only the slot proves the earlier processes gone
    assert dead_predecessors(r, keys, "w", "w.789", slot_held=False) == []
    assert dead_predecessors(r, keys, "w", "w.789", slot_held=True) == ["w.123", "w.456.1"]
    # the last record is this host's, its process gone: dead even without the slot
    r.hset(keys.worker("w"), mapping={"host": here, "pid": _dead_pid()})
    assert dead_predecessors(r, keys, "w", "w.789", slot_held=False) == ["w.123", "w.456.1"]
    # its process lives (this one stands in for it): only the slot proves it gone
    r.hset(keys.worker("w"), "pid", os.getppid())
    assert dead_predecessors(r, keys, "w", "w.789", slot_held=False) == []
    # the name was last used on another host: the lease decides, slot or not
    r.hset(keys.worker("w"), "host", here + "-elsewhere")
    assert dead_predecessors(r, keys, "w", "w.789", slot_held=True) == []


def test_claim_takes_the_entries_of_consumers_named_dead_before_their_lease(r):
    keys = Keys("claim-dead:")
    stream, group = keys.decode_stream, DECODE_GROUP
    old = Streams(r, keys, "w.100")
    new = Streams(r, keys, "w.200")
    old.ensure_group(stream, group)
    ids = [r.xadd(stream, {MESSAGE_FIELD: f"task-{i}"}).decode() for i in range(3)]
    assert [e.entry_id for e in old.read(stream, group, 10, None)] == ids
    old.beat(keys.worker("w"), {"host": "h"}, 10)  # beating: its lease runs for a minute
    new.beat(keys.worker("w"), {"host": "h"}, 10)
    assert new.claim(stream, group, 60_000, 10) == []
    claimed = new.claim(stream, group, 60_000, 10, dead=["w.100"])
    assert [(e.entry_id, e.payload, e.deliveries) for e in claimed] == [
        (i, f"task-{n}".encode(), 2) for n, i in enumerate(ids)
    ]
    assert r.get(keys.fence("w.100")) == b"f"  # fenced: a late step of it is refused
    assert old.beat(keys.worker("w"), {"host": "h"}, 10) == (False, True)
    pending = r.xpending_range(stream, group, "-", "+", 10)
    assert {p["consumer"].decode() for p in pending} == {"w.200"}
