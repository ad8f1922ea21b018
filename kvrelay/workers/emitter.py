"""The IO side of a worker: items the compute loop hands to the emitter thread, and the
heartbeat (worker hash with TTL, served models, lease renewal, drain flag, stream trimming).

Compute never waits on Redis: it puts `Outgoing` items on a queue.Queue and one emitter thread
writes them in order (one step script call per batch, fenced per worker). A fenced step (a
claim took this consumer's entries) makes the worker drop everything and come back as a new
consumer (`on_fenced`); cancels and feed changes come back with each step.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import cast

import msgspec
import redis

from kvrelay.core.errors import KvrelayError
from kvrelay.core.keys import MESSAGE_FIELD
from kvrelay.core.messages import TokenChunk, decode_chunks, frame
from kvrelay.core.worker_record import HEARTBEAT_FIELDS, WorkerRecord
from kvrelay.pipeline.queue.progress import Progress
from kvrelay.pipeline.queue.streams import StepStatus, StepWrite, Streams, WriteMode
from kvrelay.workers.engine.sequence import crowded_tenant
from kvrelay.workers.publication import ModelPublication

logger = logging.getLogger(__name__)


class OutgoingKind(enum.StrEnum):
    """What an `Outgoing` item writes."""

    EMIT = "emit"  # a chunk of a request (fenced; `done` for the final one)
    HANDOFF = "handoff"  # a chunk and the next stage's task (fenced)
    DEAD_LETTER = "dead_letter"  # the entry to the DLQ (fenced)
    RELEASE = "release"  # the entry back to the group, claimable at once


# a request's tail (chunks not yet in out:{id}) is flushed at this many chunks or bytes: a
# flush costs ~5 Valkey commands whatever its size; a long tail keeps more step fields in the
# worker's tail hash, which a reader that attaches (or a claimant) walks; 16 KiB is ~240
# chunks of one token
FLUSH_CHUNKS = 256
FLUSH_BYTES = 16384

# what a worker keeps of its writes to repair them after a failover (`Emitter.repair`): the
# chunks it flushed to out:{id} and the final write (hand-off, end) of a request it let go,
# for this long: a promoted replica lacks at most the writes of the replication lag before
# the primary died, and the heartbeat notices the new primary within a beat
RETAIN_S = 60.0

# the heartbeat rewrites the model's entry (and refreshes its files' week-long expiry) this
# often, not every beat: readers only skip an entry no worker has stamped for a week
REPUBLISH_S = 30.0


@dataclass(slots=True)
class Outgoing:
    """One write for the emitter: a chunk, a hand-off (chunk + next task) or a dead letter."""

    kind: OutgoingKind
    request_id: str
    entry_id: str
    chunk: TokenChunk | None = None
    payload: bytes = b""  # the next stage's task (HANDOFF) or the entry's (DEAD_LETTER)
    reason: str = ""
    req_fields: dict[str, str | int | float] = field(default_factory=dict)
    done: bool = False  # the entry is finished (acked) once this write succeeds
    write: StepWrite | None = None  # built once, so a retried write is the same write
    step: tuple[int, int] | None = None  # (generation, step number) it was first sent with
    # the consumer generation of the worker that made it (`Streams.generation`): after a
    # rejoin the older generations' items are dropped, even for an entry claimed back since
    generation: int = 0
    sent: bool = False  # a step with it was written (or found written): not sent again
    repaired: bool = False  # a final write sent again by `Emitter.repair` (its write kept)


class _Behind(KvrelayError):
    """The server lost steps this consumer had written (`StepStatus.BEHIND`); caught by the
    emitter loop, which repairs before its next write."""


def merged(a: Outgoing, b: Outgoing) -> Outgoing | None:
    """`b` with `a`'s chunk in front of its own, when `a` and `b` are consecutive chunks of
    one request not yet sent: one write of a chunk with both steps' tokens (as a speculative
    step makes); None when they must stay two writes."""
    ca, cb = a.chunk, b.chunk
    if (
        a.kind != OutgoingKind.EMIT
        or b.kind != OutgoingKind.EMIT
        or (a.request_id, a.entry_id, a.generation) != (b.request_id, b.entry_id, b.generation)
        or a.write is not None
        or b.write is not None
        or a.done
        or a.req_fields
        or ca is None
        or cb is None
        or not ca.token_ids
        or not cb.token_ids  # (an end without tokens, a cancel's, stays one)
        or ca.finished
        or ca.error is not None
        or cb.prompt_logprobs is not None
        or cb.index != ca.index + len(ca.token_ids)
        or (ca.logprobs is None) != (cb.logprobs is None)
    ):
        return None
    chunk = msgspec.structs.replace(
        cb,
        index=ca.index,
        token_ids=[*ca.token_ids, *cb.token_ids],
        text=ca.text + cb.text,
        logprobs=None if ca.logprobs is None else [*ca.logprobs, *(cb.logprobs or ())],
        prompt_logprobs=ca.prompt_logprobs,
    )
    return replace(b, chunk=chunk)


def coalesce(items: list[Outgoing]) -> list[Outgoing]:
    """`items` with each request's consecutive chunks (steps queued while a write was in
    flight, or held for the stream interval) merged into one write each (`merged`); the
    order of everything else is kept."""
    out: list[Outgoing] = []
    last: dict[str, int] = {}  # request id -> its latest write in `out`
    for item in items:
        at = last.get(item.request_id)
        if item.kind != OutgoingKind.EMIT:
            last.clear()  # (nothing merges across a hand-off, a release or a dead letter)
        elif at is not None and (both := merged(out[at], item)) is not None:
            out[at] = both
            continue
        last[item.request_id] = len(out)
        out.append(item)
    return out


class Emitter:
    """Writes Outgoing items in order from its own thread: the chunks queued since its last
    write go out in one step call (`Streams.step`), a request's chunks of several engine steps
    merged into one (`coalesce`); requests found cancelled go to `cancels`, writes that failed
    to `lost`. With `interval_s`, a write of only further tokens of requests already streaming
    waits until `interval_s` after the previous write (first chunks, ends, hand-offs, releases
    and dead letters go at once): fewer Valkey calls than engine steps, each token later by up
    to the interval. While nothing is written for `check_s` and requests are held, a step
    without writes reads the control list. A fenced step calls `on_fenced` with the fenced
    consumer name (the worker rejoins as a new consumer and drops what it held)."""

    def __init__(
        self,
        streams: Streams,
        stream: str,
        group: str,
        inflight: Inflight,
        *,
        next_stream: str = "",
        cancels: queue.Queue[str] | None = None,
        check_s: float = 0.25,
        interval_s: float = 0.0,
        on_fenced: Callable[[str], None] | None = None,
    ):
        self.streams, self.stream, self.group = streams, stream, group
        self.next_stream = next_stream or stream
        self.inflight = inflight
        self.check_s = check_s
        self.interval_s = interval_s
        self.queue: queue.Queue[Outgoing | None] = queue.Queue()
        self.lost: queue.Queue[str] = queue.Queue()
        self.cancels: queue.Queue[str] = cancels if cancels is not None else queue.Queue()
        self.on_fenced = on_fenced or (lambda consumer: None)
        # request id -> its tail: chunk index -> payload, written since its last flush
        self._tail: dict[str, dict[int, bytes]] = {}
        # request id -> the step whose tail field holds its tail's first chunk, and the steps
        # that wrote a tail field still in the tail hash: the fields older than every tail's
        # first step are dropped with the next step
        self._tail_since: dict[str, int] = {}
        self._tail_steps: list[int] = []
        # request id -> the feeds following it (from its admission, then the control list)
        self._feeds: dict[str, list[str]] = {}
        self._tail_lock = threading.Lock()
        self._generation = -1  # the streams' generation the step numbers below belong to
        self._step_no = 0  # this consumer's last step number
        self._last_ok = 0  # the last step number the server said it holds (0: not known)
        self._acked = 0  # control items the last step returned (the next one drops them)
        # for `repair`: request id -> the chunks flushed to out:{id} (time, index, payload), and
        # request id -> (time, its final write, its flushed chunks) once let go
        self._sent: dict[str, list[tuple[float, int, bytes]]] = {}
        self._done: dict[str, tuple[float, Outgoing, list[tuple[float, int, bytes]]]] = {}
        self._force: set[str] = set()  # requests whose next write is a flush (a repair)
        self._repair = threading.Event()
        self.repairs = 0  # repairs run (a failover noticed)
        self.thread = threading.Thread(target=self._run, name="emitter", daemon=True)

    def put(self, item: Outgoing) -> None:
        self.queue.put(item)

    def follow(self, request_id: str, feeds: list[str]) -> None:
        """The feeds following an admitted request (reader thread)."""
        with self._tail_lock:
            self._feeds[request_id] = list(feeds)

    def request_repair(self) -> None:
        """The server reached is another one (a failover, a restart): compare what it holds
        with what this worker wrote, on the emitter thread before its next write (`repair`)."""
        self._repair.set()

    def drop_all(self) -> None:
        """Forget every tail and feed (the worker rejoined as a new consumer; the old one's
        tail hash stays for the admissions that move its requests' tails)."""
        with self._tail_lock:
            self._tail.clear()
            self._feeds.clear()
            self._tail_since.clear()
            self._sent.clear()
            self._done.clear()
            self._force.clear()

    def close(self, timeout: float = 10.0) -> None:
        """Flush everything queued, then stop the thread."""
        self.queue.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        stopping = False
        checked = time.monotonic()  # the control list was last read with a step then
        wrote = float("-inf")  # the last write with chunks started then
        while not stopping:
            if self._repair.is_set():
                self._repair.clear()
                self._repair_safely()
            try:
                wait = max(0.0, checked + self.check_s - time.monotonic())
                items = [self.queue.get(timeout=wait)]
            except queue.Empty:
                items = []
            checked = time.monotonic()
            self._drain(items)
            while items and None not in items and not self._urgent(items):
                now = time.monotonic()
                if now >= wrote + self.interval_s or len(items) >= 1024:
                    break
                if now >= checked + self.check_s:  # holding: cancels are read all the same
                    self._check()
                    checked = now
                wait = min(wrote + self.interval_s, checked + self.check_s) - now
                try:
                    items.append(self.queue.get(timeout=max(0.0, wait)))
                except queue.Empty:
                    continue
                self._drain(items)
            if None in items:
                stopping = True
                items = [i for i in items if i is not None]
                if not items:
                    break
            batch = coalesce(cast("list[Outgoing]", items))  # (the None, stop, is out)
            if batch:
                wrote = time.monotonic()
            try:
                self._write(batch)
            except Exception:  # the emitter must outlive any one bad write
                logger.exception("emitter: dropping %d writes", len(batch))
                for item in batch:
                    self._forget(item)
                    self.lost.put(item.request_id)

    def _repair_safely(self) -> None:
        while True:
            try:
                self._write(self.repair())
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                logger.warning("emitter: redis unavailable during a repair (%s); retrying", exc)
                time.sleep(0.5)
            except Exception:  # the emitter must outlive a failed repair
                logger.exception("emitter: repairing after a failover failed")
                return

    def repair(self) -> list[Outgoing]:
        """After a failover (`request_repair`): what the promoted replica lacks of this
        worker's writes (asynchronous replication loses the primary's last ones) is written
        again from memory. A held request whose out:{id} stops before chunks flushed here gets
        them back with its next write (a flush: the tail and them), and so does one with a
        tail (its steps may be lost: the next write flushes it whole). An entry pending under
        this consumer that it let go (its hand-off or end was lost with the primary: the write
        is one script, lost whole) gets its final write again, with the chunks out:{id} lacks;
        any other pending entry it does not hold is released, claimable at once.
        A held request the server does not give this consumer is dropped (put on `lost`: the
        compute loop ends it without a word): its entry is not pending under it (the server
        lost its delivery, so another worker may read it now), or its progress names another
        owner (the server lost its admission: cancels and readers would go elsewhere), then its
        entry is released too. Running it on would make two writers of its tokens, whose
        chunks readers get split differently over the same indices. Returns the final writes
        to send again (held again: `inflight`)."""
        consumer, generation = self.streams.identity
        r = self.streams.r
        with self.streams.lock:  # (no entry is read and not yet held meanwhile)
            pending = r.xpending_range(
                self.stream, self.group, "-", "+", 10000, consumername=consumer
            )
            held = self.inflight.snapshot()
            # what the server counts of this consumer's admissions: the steps' check from now
            self.streams.admitted = self.streams.admitted_on_server()
            rids = list(held)
            owners = r.hmget(self.streams.keys.progress, rids) if rids else []
        self.repairs += 1
        pending_ids = {as_text(cast("bytes | str", row["message_id"])) for row in pending}
        lost_admission: list[tuple[str, str]] = []
        for request_id, raw in zip(rids, owners, strict=True):
            entry = held[request_id]
            progress = Progress.parse(cast("bytes | None", raw))
            if entry not in pending_ids:
                logger.warning(
                    "request %s: entry %s is not pending under %s on this server (its "
                    "delivery was lost): dropped here",
                    request_id,
                    entry,
                    consumer,
                )
            elif progress is not None and progress.owner != f"{consumer}/{entry}":
                logger.warning(
                    "request %s: this server lost its admission by %s: released",
                    request_id,
                    consumer,
                )
                lost_admission.append((entry, request_id))
            else:
                continue
            self._drop(request_id, entry)
            del held[request_id]
        if lost_admission:
            self.streams.release(self.stream, self.group, lost_admission)
        self._last_ok = 0  # (what the server holds is known again once a step is written)
        holding = {entry: rid for rid, entry in held.items()}
        holding.update(lost_admission)  # (released already)
        resend: list[Outgoing] = []
        release: list[tuple[str, str]] = []
        with self._tail_lock:
            done = {item.entry_id: (item, sent) for _t, item, sent in self._done.values()}
        for row in pending:
            entry = as_text(cast("bytes | str", row["message_id"]))
            if entry in holding:
                continue
            if entry in done:
                item, sent = done[entry]
                if item.write is None or item.generation != generation:
                    continue
                missing = _missing(sent, self._out_count(item.request_id))
                history = b"".join(frame(p) for p in missing) or item.write.history
                resend.append(
                    replace(
                        item,
                        write=replace(item.write, history=history),
                        step=None,
                        sent=False,
                        repaired=True,
                    )
                )
            else:
                rid = self._request_of(entry)
                if rid is not None:
                    release.append((entry, rid))
        for rid in held:
            with self._tail_lock:
                sent = list(self._sent.get(rid, ()))
                if self._tail.get(rid):
                    # the server may lack the steps that put its tail's chunks in the tail
                    # hash (a reader then finds the tail up to the first lost one, and the
                    # live chunks after a hole): its next write flushes the tail whole
                    self._force.add(rid)
            if not sent:
                continue
            missing = _missing(sent, self._out_count(rid), with_index=True)
            if not missing:
                continue
            with self._tail_lock:
                tail = self._tail.setdefault(rid, {})
                merged_tail = dict(missing)
                merged_tail.update(tail)
                self._tail[rid] = dict(sorted(merged_tail.items()))
                self._force.add(rid)
            logger.warning(
                "request %s: out:{id} lacks %d chunks after a failover; written again",
                rid,
                len(missing),
            )
        if release:
            with self.streams.lock:  # (an entry the reader took back since is held: kept)
                now_held = set(self.inflight.snapshot().values())
                release = [(entry, rid) for entry, rid in release if entry not in now_held]
                logger.warning(
                    "releasing %d pending entries this worker does not hold", len(release)
                )
                self.streams.release(self.stream, self.group, release)
        if resend:
            logger.warning("%d hand-offs or ends lost with the primary; written again", len(resend))
            for item in resend:
                self.inflight.add(item.request_id, item.entry_id)
        return resend

    def _drop(self, rid: str, entry: str) -> None:
        """Stop running a held request (its entry is not this consumer's on the server): no
        write of it goes from here on; the compute loop ends it without a word (`lost`)."""
        self.inflight.remove(rid, entry)
        with self._tail_lock:
            self._tail.pop(rid, None)
            self._feeds.pop(rid, None)
            self._tail_since.pop(rid, None)
            self._sent.pop(rid, None)
            self._force.discard(rid)
        self.lost.put(rid)

    def retained(self) -> set[str]:
        """Entries this worker let go whose final write it keeps for a repair: not taken
        back by the reader (a repair sends their final write again)."""
        with self._tail_lock:
            return {item.entry_id for _t, item, _sent in self._done.values()}

    def _out_count(self, rid: str) -> int:
        """Tokens in out:{id} on the server (the index after its last chunk)."""
        last = self.streams.r.xrevrange(self.streams.keys.out(rid), count=1)
        if not last:
            return 0
        _eid, fields = last[0]
        run = (fields or {}).get(MESSAGE_FIELD)
        chunks = decode_chunks(cast(bytes, run)) if run else []
        if not chunks:
            return 0
        return chunks[-1].index + len(chunks[-1].token_ids)

    def _request_of(self, entry: str) -> str | None:
        """The request id of a stream entry (None when it is gone or has none)."""
        rows = self.streams.r.xrange(self.stream, entry, entry)
        if not rows:
            return None
        fields = rows[0][1] or {}
        payload = fields.get(MESSAGE_FIELD)
        try:
            rid = (
                msgspec.msgpack.decode(cast(bytes, payload)).get("request_id") if payload else None
            )
        except (msgspec.DecodeError, AttributeError):
            return None
        return rid if isinstance(rid, str) else None

    def _check(self) -> None:
        """A step without writes (the control list: cancels, feeds) while chunks are held."""
        try:
            self._write([])
        except Exception:  # the emitter must outlive any one bad write
            logger.exception("emitter: reading the control list failed")

    def _drain(self, items: list[Outgoing | None]) -> None:
        """Append what the queue holds now to `items` (1,024 at most)."""
        while len(items) < 1024:
            try:
                items.append(self.queue.get_nowait())
            except queue.Empty:
                return

    def _urgent(self, items: list[Outgoing | None]) -> bool:
        """Whether `items` must go without waiting for the stream interval: anything but
        further tokens of requests already streaming from here (a first chunk, an end, a
        hand-off, a release, a dead letter, record fields)."""
        if self.interval_s <= 0:
            return True
        with self._tail_lock:
            return any(
                item is None
                or item.kind != OutgoingKind.EMIT
                or item.done
                or item.req_fields
                or item.request_id not in self._tail
                for item in items
            )

    def _write(self, items: list[Outgoing]) -> None:
        while True:
            try:
                self._write_once(items)
                return
            except _Behind:
                # the server lacks steps it had acknowledged: write again from memory what they
                # held (`repair`), and build the writes not sent yet again after that (their
                # flushes then carry the chunks out:{id} lacks)
                logger.warning("emitter: the server lost this worker's last steps; repairing")
                resend = self.repair()
                for item in items:
                    if not item.sent and not item.repaired:
                        item.write, item.step = None, None
                items[:0] = resend
                self._last_ok = 0
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Valkey restarting: retry; the writes are fenced, so a repeat cannot duplicate
                logger.warning("emitter: redis unavailable (%s); retrying", exc)
                time.sleep(0.5)

    def _write_once(self, items: list[Outgoing]) -> None:
        if not items:
            if len(self.inflight):
                self._step([])  # nothing to write: read the control list only
            return
        batch: list[Outgoing] = []
        for item in items:
            if item.generation != self.streams.generation:
                continue  # made for a consumer since fenced: its requests are another's
            if item.kind in (OutgoingKind.EMIT, OutgoingKind.HANDOFF):
                batch.append(item)
                continue
            self._step(batch)
            batch = []
            if item.kind == OutgoingKind.RELEASE:  # after the writes queued before it
                self.streams.release(self.stream, self.group, [(item.entry_id, item.request_id)])
            else:
                self.streams.dead_letter(
                    self.stream,
                    self.group,
                    item.entry_id,
                    item.payload,
                    item.reason,
                    item.request_id,
                )
            self._forget(item)
        self._step(batch)
        del items[:]

    def _step(self, batch: list[Outgoing]) -> None:
        """Write `batch` in as few step calls as its order allows (one per request per call).

        Only writes of entries this consumer holds go (a rejoin dropped the others: the compute
        loop drops their requests by generation). Each call has a step number, kept with its
        items, so the retry of a call whose reply was lost repeats it and writes nothing."""
        while True:
            consumer, generation = self.streams.identity  # read before what it holds
            if generation != self._generation:
                self._generation, self._step_no, self._acked = generation, 0, 0
                self._last_ok = 0
                with self._tail_lock:
                    self._tail_steps.clear()  # the steps of the consumer's hash before
            held = self.inflight.snapshot()
            batch = [
                item
                for item in batch
                if item.generation == generation
                and held.get(item.request_id) == item.entry_id
                and not item.sent
            ]
            seen: set[str] = set()
            now: list[Outgoing] = []
            for item in batch:
                if item.request_id in seen or (now and item.step != now[0].step):
                    break  # (items sent before go again together, under their number)
                seen.add(item.request_id)
                now.append(item)
            if not now and not held:
                return
            step = now[0].step if now else None
            if step is None or step[0] != generation:
                self._step_no += 1
                step = (generation, self._step_no)
            for item in now:
                item.step = step
            writes = [self._write_of(item, step[1]) for item in now]  # built once per item
            with self._tail_lock:
                feeds = {item.request_id: self._feeds.get(item.request_id, []) for item in now}
                floor = min(self._tail_since.values(), default=step[1])
                drop = [s for s in self._tail_steps if s < floor]
            res = self.streams.step(
                self.stream,
                self.group,
                self.next_stream,
                writes,
                feeds,
                step[1],
                self._acked,
                consumer=consumer,
                drop_steps=drop,
                after=self._last_ok,
                admitted=self.streams.admitted if consumer == self.streams.consumer else 0,
            )
            if res.status == StepStatus.BEHIND:
                raise _Behind
            if res.status == StepStatus.FENCED and self.streams.consumer != consumer:
                continue  # rejoined meanwhile: what is held now goes under the new name
            if res.status == StepStatus.FENCED:
                logger.warning(
                    "consumer %s was fenced (its entries were claimed): dropping %d requests "
                    "and %d writes; rejoining as a new consumer",
                    consumer,
                    len(held),
                    len(batch),
                )
                self.on_fenced(consumer)
                return
            self._acked = res.num_control
            self._last_ok = max(self._last_ok, step[1])
            for item in now:
                item.sent = True
            with self._tail_lock:
                self._tail_steps = [s for s in self._tail_steps if s >= floor]
                if any(w.mode == WriteMode.EMIT for w in writes) and (
                    not self._tail_steps or self._tail_steps[-1] != step[1]
                ):
                    self._tail_steps.append(step[1])
                for rid, feed_ids in res.feeds.items():
                    if rid in held:
                        self._feeds[rid] = feed_ids
            for rid in res.cancelled:
                if rid in held:
                    self.cancels.put(rid)
            for item in now:
                if item.done:
                    with self._tail_lock:
                        sent = self._sent.get(item.request_id, [])
                        at = time.monotonic()
                        self._done.pop(item.request_id, None)
                        self._done[item.request_id] = (at, item, sent)
                        while (first := next(iter(self._done.values())))[0] < at - RETAIN_S:
                            self._done.pop(first[1].request_id)
                    self._forget(item)
            batch = batch[len(now) :]
            if not batch:
                return

    def _write_of(self, item: Outgoing, step_no: int) -> StepWrite:
        """The item's StepWrite: the chunk joins the request's tail (in step `step_no`'s field
        of the tail hash), or the tail and the chunk go to out:{id} (at a hand-off, the end, or
        when the tail is long)."""
        if item.write is not None:
            return item.write
        rid = item.request_id
        chunk = item.chunk or TokenChunk()
        payload = chunk.encode()
        with self._tail_lock:
            tail = self._tail.setdefault(rid, {})
            size = sum(len(p) for p in tail.values()) + len(payload)
            if item.kind == OutgoingKind.HANDOFF:
                mode = WriteMode.HANDOFF
            elif item.done:
                mode = WriteMode.DONE
            elif (
                rid in self._force
                or len(tail) + 1 >= FLUSH_CHUNKS
                or size >= FLUSH_BYTES
                or not chunk.token_ids  # (a chunk without tokens cannot be found in a tail)
                or item.req_fields  # record fields are written with a flush
            ):
                mode = WriteMode.FLUSH
            else:
                mode = WriteMode.EMIT
            write = StepWrite(
                item.entry_id, rid, chunk, mode, item.payload, item.req_fields or None,
                payload=payload,
            )  # fmt: skip
            if mode == WriteMode.EMIT:
                tail[chunk.index] = payload
                self._tail_since.setdefault(rid, step_no)
            else:
                tail.pop(chunk.index, None)  # (a write built again after a repair)
                write.history = b"".join(frame(p) for p in tail.values()) + frame(payload)
                now = time.monotonic()
                sent = [
                    s
                    for s in self._sent.get(rid, ())
                    if now - s[0] <= RETAIN_S and s[1] not in tail
                ]
                sent += [(now, index, p) for index, p in tail.items()]
                sent.append((now, chunk.index, payload))
                self._sent[rid] = sent
                tail.clear()
                self._tail_since.pop(rid, None)
                self._force.discard(rid)
        item.write = write
        return write

    def _forget(self, item: Outgoing) -> None:
        self.inflight.remove(item.request_id, item.entry_id)
        with self._tail_lock:
            self._tail.pop(item.request_id, None)
            self._feeds.pop(item.request_id, None)
            self._tail_since.pop(item.request_id, None)
            self._sent.pop(item.request_id, None)
            self._force.discard(item.request_id)


def _missing(sent: list[tuple[float, int, bytes]], count: int, with_index: bool = False) -> list:
    """The flushed chunks (index >= `count`) a server whose out:{id} holds `count` tokens lacks,
    in index order: payloads, or (index, payload) pairs."""
    rows = sorted((index, p) for _t, index, p in sent if index >= count)
    return rows if with_index else [p for _i, p in rows]


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Inflight:
    """Entries this worker owns (request id -> entry id), shared by the IO threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, str] = {}
        # each held request's priority, tenant and weight (what a full reader may displace)
        self._claims: dict[str, tuple[int, str, float]] = {}

    def add(
        self,
        request_id: str,
        entry_id: str,
        priority: int = 0,
        tenant: str = "",
        weight: float = 1.0,
    ) -> bool:
        with self._lock:
            if request_id in self._entries:
                return False
            self._entries[request_id] = entry_id
            self._claims[request_id] = (priority, tenant, weight)
            return True

    def remove(self, request_id: str, entry_id: str | None = None) -> None:
        with self._lock:
            if entry_id is None or self._entries.get(request_id) == entry_id:
                self._entries.pop(request_id, None)
                self._claims.pop(request_id, None)

    def crowding(self) -> tuple[int, str] | None:
        """(the worst priority held, the tenant holding the most of it for its weight when
        that is two or more, else ""); None when nothing is held."""
        with self._lock:
            claims = list(self._claims.values())
        if not claims:
            return None
        worst = max(priority for priority, _t, _w in claims)
        tenant, slots, _share = crowded_tenant((t, w) for p, t, w in claims if p == worst)
        return worst, tenant if slots >= 2 else ""

    def get(self, request_id: str) -> str | None:
        with self._lock:
            return self._entries.get(request_id)

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._entries)

    def clear(self) -> dict[str, str]:
        """Forget every entry (the worker rejoined as a new consumer); what was held."""
        with self._lock:
            held, self._entries = self._entries, {}
            self._claims = {}
            return held

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class Heartbeat:
    """Publishes worker:{name} (with TTL), the consumer's beat (its lease on every entry it
    holds: nothing is renewed per entry) and, every REPUBLISH_S and after a fence, the served
    model (`ModelPublication`: numbers, defaults, tokenizer files); reads `drain`.

    `info` holds the worker's fixed fields (model, fingerprint, ...); each beat fills in who it
    is and its load, `stats` adds the moment's counts, and `WorkerRecord.encode` writes it."""

    def __init__(
        self,
        streams: Streams,
        name: str,
        role: str,
        stream: str,
        group: str,
        inflight: Inflight,
        interval_s: float,
        ttl_s: int,
        info: WorkerRecord,
        publication: ModelPublication | None,
        stats: Callable[[WorkerRecord], WorkerRecord] = lambda record: record,
        on_fenced: Callable[[str], None] | None = None,
        on_new_server: Callable[[], None] | None = None,
    ):
        self.streams, self.name, self.role = streams, name, role
        # called when the server reached is another process than at the previous beat (its
        # INFO run_id changed: a failover promoted a replica, or Valkey restarted)
        self.on_new_server = on_new_server or (lambda: None)
        self._run_id = ""
        self.stream, self.group, self.inflight = stream, group, inflight
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self.info, self.publication, self.stats = info, publication, stats
        self.on_fenced = on_fenced or (lambda consumer: None)
        self.draining = False
        self._stop = threading.Event()
        self._last_trim = float("-inf")  # trim and prune on the first beat after a (re)start
        self._last_publish = float("-inf")
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def beat(self) -> None:
        """One heartbeat: publish, beat, read the drain flag (raises on Redis errors)."""
        record = replace(
            self.info,
            name=self.name,
            role=self.role,
            host=socket.gethostname(),
            pid=os.getpid(),
            consumer=self.streams.consumer,
            updated=time.time(),
            load=len(self.inflight),
        )
        key = self.streams.keys.worker(self.name)
        fields = self.stats(record).encode(HEARTBEAT_FIELDS)
        self.draining, fenced = self.streams.beat(key, fields, self.ttl_s)
        if fenced:  # silent past a lease (a stall): its entries are another's now
            self.on_fenced(record.consumer)
        self._check_server()
        # the model's entry on the first beat, then every REPUBLISH_S, and at once after a
        # fence: a Valkey restarted without its data also reads as one (the fence key is gone)
        if self.publication is not None and (
            fenced or time.monotonic() - self._last_publish >= REPUBLISH_S
        ):
            self.publication.publish(self.streams.r, self.streams.keys)
            self._last_publish = time.monotonic()
        if time.monotonic() - self._last_trim > 30:
            self._last_trim = time.monotonic()
            self.streams.trim_acked(self.stream, self.group)
            self.streams.prune_consumers(self.stream, self.group)

    def _check_server(self) -> None:
        """Notice a different server process (`on_new_server`) by its INFO run_id: a promoted
        replica lacks the lost primary's last writes, which the worker then repairs."""
        if not isinstance(self.streams.r, redis.Redis):
            return  # (a cluster: each shard's primary is its own; no Sentinel failover)
        run_id = str(self.streams.r.info("server").get("run_id", ""))
        if self._run_id and run_id and run_id != self._run_id:
            logger.warning("a different Valkey server (run_id %s): repairing", run_id)
            self.on_new_server()
        self._run_id = run_id or self._run_id

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except redis.RedisError as exc:
                logger.warning("heartbeat failed: %s", exc)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop beating and remove the worker hash so status stops listing it."""
        self._stop.set()
        self.thread.join(5)
        with contextlib.suppress(redis.RedisError):
            self.streams.r.delete(self.streams.keys.worker(self.name))
