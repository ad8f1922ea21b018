"""A server that lost a worker's delivery or admission (a failover to a replica without the
primary's last writes, a restart from an older snapshot) must not let two workers write one
request: the overlapping SSE chunks' cause. Real Valkey, real scripts: `DEBUG RELOAD NOSAVE`
brings the server back to its last snapshot, as a promoted replica that lacks the lost
primary's last writes is (the same run_id: only the writes tell).

Without a check the worker that read the request before the loss (its delivery and admission
gone, its step numbers intact) writes on while another worker reads the entry again on the
rewound server: both publish the request's tokens, split into chunks differently, and a reader
that had tokens to 3 gets a chunk at 2. The step script now refuses a step whose caller knows
of more admissions than the server holds (BEHIND), and the worker's repair drops what the
server does not give it (`Emitter.repair`)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvrelay.core.keys import PREFILL_GROUP
from kvrelay.core.messages import TokenChunk, frame
from kvrelay.pipeline.queue.feed import OutputFeed
from kvrelay.pipeline.queue.redis_options import async_redis
from kvrelay.pipeline.queue.streams import StepStatus, StepWrite, Streams, WriteMode
from kvrelay.workers.emitter import Emitter, Inflight, Outgoing, OutgoingKind
from tests.conftest import free_port, valkey_binary
from tests.pipeline.test_streams import KEYS, D, P, add_task, make, out_chunks, take
from tests.queue_state import FeedListener, feed_chunks, progress


@pytest.fixture
def r(tmp_path: Path) -> Iterator[redis.Redis]:
    """A Valkey that can be brought back to its last snapshot (`rewind`)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            valkey_binary(),
            *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)),
            *("--appendonly", "no", "--save", "", "--enable-debug-command", "yes"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "valkey-server did not start"
            time.sleep(0.02)
    yield client
    client.close()
    proc.kill()
    proc.wait(10)


def rewind(r: redis.Redis) -> None:
    """The server as of its last SAVE: what a replica that lags holds when it is promoted."""
    assert r.execute_command("DEBUG", "RELOAD", "NOSAVE") in (b"OK", "OK", True)


def published(listener: FeedListener) -> list[tuple[int, list[int]]]:
    """The chunks of r1 on the feed, in order: (index, token ids)."""
    chunks = [feed_chunks(m).get("r1") for m in listener.messages()]
    return [(c.index, c.token_ids) for c in chunks if c is not None]


def emitter_of(streams: Streams, held: dict[str, str]) -> Emitter:
    inflight = Inflight()
    for rid, entry in held.items():
        inflight.add(rid, entry)
    return Emitter(streams, P, PREFILL_GROUP, inflight, next_stream=D)


def test_without_the_admission_check_two_workers_write_one_request(r):
    """The cause, shown: after the server lost `a`'s delivery, `b` reads the entry again and
    both write r1's tokens, chunked differently: the feed's reader gets [0, 3) from `a`, then
    a chunk at 2 from `b` (the SSE event at 49 after tokens to 51)."""
    a, b = make(r, "a"), make(r, "b")
    add_task(r, "r1", feed="f1")
    listener = FeedListener(r, KEYS.feed("f1"))
    r.save()
    [entry] = take(a)
    rewind(r)
    assert r.xpending_range(P, PREFILL_GROUP, "-", "+", 10) == []  # the delivery is gone
    assert take(b) == [entry]  # undelivered here: the next reader gets it
    assert a.step(StepWrite(entry, "r1", TokenChunk(0, [5, 6, 7]))).status == StepStatus.OK
    assert b.step(StepWrite(entry, "r1", TokenChunk(0, [5, 6]))).status == StepStatus.OK
    assert b.step(StepWrite(entry, "r1", TokenChunk(2, [7, 8]))).status == StepStatus.OK
    assert published(listener) == [(0, [5, 6, 7]), (0, [5, 6]), (2, [7, 8])]
    listener.close()


def test_a_step_after_a_lost_admission_is_behind_and_writes_nothing(r):
    a, b = make(r, "a"), make(r, "b")
    add_task(r, "r1", feed="f1")
    listener = FeedListener(r, KEYS.feed("f1"))
    r.save()
    [entry] = take(a)
    assert a.s.admitted == 1 and r.get(a.s.admitted_key()) == b"1"
    rewind(r)
    assert r.get(a.s.admitted_key()) is None
    assert take(b) == [entry]
    chunk = StepWrite(entry, "r1", TokenChunk(0, [5, 6, 7]))
    late = a.s.step(P, PREFILL_GROUP, D, [chunk], a.feeds, 1, admitted=a.s.admitted)
    assert late.status == StepStatus.BEHIND
    assert r.get(KEYS.fence("a")) == b"0"  # (the fence keeps its step number)
    assert r.hgetall(KEYS.tail("a")) == {} and published(listener) == []
    # a count the server holds (b's own) passes
    b_chunk = StepWrite(entry, "r1", TokenChunk(0, [5, 6]))
    ok = b.s.step(P, PREFILL_GROUP, D, [b_chunk], b.feeds, 1, admitted=b.s.admitted)
    assert ok.status == StepStatus.OK and published(listener) == [(0, [5, 6])]
    listener.close()


def test_the_repair_drops_a_request_whose_delivery_the_server_lost(r):
    """`a`'s emitter: its write is refused (BEHIND), its repair finds r1's entry pending under
    `b`, not `a`: r1 is dropped (on `lost`, for the compute loop), nothing of it is written,
    and `a` steps on from the server's admission count."""
    a, b = make(r, "a"), make(r, "b")
    add_task(r, "r0")
    add_task(r, "r1", feed="f1")
    listener = FeedListener(r, KEYS.feed("f1"))
    [kept] = take(a)  # r0: a's, on the snapshot too
    r.save()
    [entry] = take(a)
    assert a.s.admitted == 2
    rewind(r)
    assert take(b) == [entry]
    emitter = emitter_of(a.s, {"r0": kept, "r1": entry})
    emitter._write(
        [
            Outgoing(OutgoingKind.EMIT, "r0", kept, chunk=TokenChunk(0, [4])),
            Outgoing(OutgoingKind.EMIT, "r1", entry, chunk=TokenChunk(0, [5, 6, 7])),
        ]
    )
    assert emitter.repairs == 1 and emitter.lost.get_nowait() == "r1" and emitter.lost.empty()
    assert emitter.inflight.snapshot() == {"r0": kept}
    assert a.s.admitted == 1  # the server's count: its steps check against it from here
    assert published(listener) == []  # nothing of r1 from a
    assert [c.index for c in a.s.history("r0")] == [0]  # r0's chunk went
    assert progress(r, KEYS, "r1").owner == f"b/{entry}"
    listener.close()


def test_the_repair_releases_a_request_whose_admission_the_server_lost(r):
    """The server kept `a`'s delivery but lost its admission: the entry is pending under `a`
    while r1's progress names no owner (cancels and readers would not reach `a`): released,
    claimable at once, and dropped here."""
    a = make(r, "a")
    add_task(r, "r1", feed="f1")
    [read] = a.read(P, PREFILL_GROUP, 1, None)
    r.save()
    a.admit([(read.entry_id, "r1", 0, {})])
    assert progress(r, KEYS, "r1").owner == f"a/{read.entry_id}"
    rewind(r)
    assert progress(r, KEYS, "r1").owner == ""
    emitter = emitter_of(a.s, {"r1": read.entry_id})
    emitter._write([Outgoing(OutgoingKind.EMIT, "r1", read.entry_id, chunk=TokenChunk(0, [5]))])
    assert emitter.lost.get_nowait() == "r1" and len(emitter.inflight) == 0
    [row] = r.xpending_range(P, PREFILL_GROUP, "-", "+", 10)
    assert (row["message_id"].decode(), row["consumer"]) == (read.entry_id, b"released")
    assert r.hgetall(KEYS.tail("a")) == {}


def test_the_repair_flushes_a_tail_whose_steps_the_server_lost(r):
    """The server lost a step that put a chunk in `a`'s tail hash ([2, 4)): the next write of
    the request after the repair is a flush of the whole tail, so out:{id} has no hole."""
    a = make(r, "a")
    add_task(r, "r1")
    [entry] = take(a)
    emitter = emitter_of(a.s, {"r1": entry})
    emitter._write([Outgoing(OutgoingKind.EMIT, "r1", entry, chunk=TokenChunk(0, [5, 6]))])
    r.save()
    emitter._write([Outgoing(OutgoingKind.EMIT, "r1", entry, chunk=TokenChunk(2, [7, 8]))])
    rewind(r)
    assert [c.index for c in a.s.history("r1")] == [0]  # the tail as the server has it
    emitter._write([Outgoing(OutgoingKind.EMIT, "r1", entry, chunk=TokenChunk(4, [9]))])
    assert emitter.repairs == 1 and emitter.lost.empty()
    assert [(c.index, c.token_ids) for c in out_chunks(r, "r1")] == [
        (0, [5, 6]),
        (2, [7, 8]),
        (4, [9]),
    ]


def test_a_reader_does_not_skip_the_tokens_a_lost_step_held(r, caplog):
    """The server lost the step with r1's chunk [2, 4) (its worker, repairing, writes it again
    with its next flush). A reader that attaches meanwhile has history to 2, then the feed
    brings the chunk at 4: taking it would skip tokens 2 and 3 (the reader resuming after
    Last-Event-ID 1 never gets them). It waits for the history that covers it instead."""
    a = make(r, "a")
    add_task(r, "r1")
    [entry] = take(a)
    first = TokenChunk(0, [5, 6], "ab")
    assert a.step(StepWrite(entry, "r1", first, WriteMode.FLUSH)).status == StepStatus.OK
    lost = TokenChunk(2, [7, 8], "cd")  # its step is what the server lost
    after = TokenChunk(4, [9], "e")
    final = TokenChunk(5, [10], "f", finish_reason="length")
    port = r.connection_pool.connection_kwargs["port"]
    got: list[TokenChunk] = []

    async def main() -> None:
        client = async_redis(f"redis://127.0.0.1:{port}/0", 4)
        feed = OutputFeed(client, KEYS, block_ms=100)
        reader = asyncio.create_task(_collect(feed.chunks("r1", start_index=2), got))
        await _until(lambda: bool(progress(r, KEYS, "r1").feeds))  # attached
        assert a.step().status == StepStatus.OK  # a learns the feed
        a.no += 2  # (steps 3 and 4 were lost with the server)
        assert a.step(StepWrite(entry, "r1", after)).status == StepStatus.OK
        await _until(lambda: "history ends at 2, before the chunk at 4" in caplog.text)
        assert got == []  # not the chunk at 4: tokens 2 and 3 are not known yet
        done = StepWrite(entry, "r1", final, WriteMode.DONE)
        done.history = b"".join(frame(c.encode()) for c in (lost, after, final))
        assert a.step(done).status == StepStatus.OK
        await asyncio.wait_for(reader, 10)
        await feed.stop()
        await client.aclose()

    asyncio.run(main())
    assert [(c.index, c.token_ids, c.text) for c in got] == [
        (2, [7, 8], "cd"),
        (4, [9], "e"),
        (5, [10], "f"),
    ]


async def _collect(agen, got: list[TokenChunk]) -> None:
    async for chunk in agen:
        got.append(chunk)


async def _until(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)
