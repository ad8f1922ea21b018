"""The reader thread of a worker: XREADGROUP new entries, claim the entries of consumers whose
worker stopped beating; validated tasks are admitted (one script call per batch: this worker
becomes their owner) and go to the compute loop's admission queue, poison to the DLQ (through
the emitter, so writes stay in order). Cancels and feed changes come back from the emitter's
steps (the consumer's control list)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import redis

from kvrelay.core import record as rec
from kvrelay.core.enums import RequestStatus, Stage
from kvrelay.core.messages import DecodeTask, MessageError, PrefillTask, Task
from kvrelay.core.record import RequestRecord
from kvrelay.pipeline.queue.streams import Admitted, Entry, Streams, emitted_of
from kvrelay.workers.config import WorkerConfig
from kvrelay.workers.emitter import Emitter, Heartbeat, Inflight, Outgoing, OutgoingKind
from kvrelay.workers.engine_api import EngineAPI
from kvrelay.workers.errors import InvalidRequestError
from kvrelay.workers.metrics import WorkerMetrics

logger = logging.getLogger(__name__)
# a full worker looks this often for a request worth displacing one of its own for (a better
# priority, another tenant): how late such a request can be taken at most
DISPLACE_POLL_S = 0.02


@dataclass(slots=True)
class Admission:
    entry_id: str
    task: Task
    emitted: list[int]  # tokens already in out:{id}
    cancelled: bool = False
    emitted_text_len: int | None = None  # characters in out:{id} (None: all of `emitted`'s)
    generation: int = 0  # the consumer generation that admitted it (`Streams.generation`)
    shard: int = 0  # the pipeline shard it came from (its writes go back there)
    # a holder died running it since its last progress: run alone, and say so first
    # (`Streams.ran`), so that only a death while it runs counts against it
    suspect: bool = False
    delivery: int = 1  # this holder's delivery of the entry


class ReaderHost(Protocol):
    """What the reader thread uses of its worker's shard (`workers.lane.ShardLane`)."""

    @property
    def shard(self) -> int: ...

    def room(self) -> int: ...  # sequences the worker may still take (every shard's count)

    @property
    def config(self) -> WorkerConfig: ...

    @property
    def role(self) -> Stage: ...

    @property
    def message(self) -> type[PrefillTask] | type[DecodeTask]: ...  # the stream's task type

    @property
    def name(self) -> str: ...  # the worker's: the owner of the requests it admits

    @property
    def stream(self) -> str: ...

    @property
    def group(self) -> str: ...

    @property
    def r(self) -> redis.Redis | redis.RedisCluster: ...

    @property
    def streams(self) -> Streams: ...

    @property
    def engine(self) -> EngineAPI: ...  # its grammars: compiled here, not on the compute loop

    @property
    def inflight(self) -> Inflight: ...

    @property
    def heartbeat(self) -> Heartbeat: ...  # draining: read nothing new

    @property
    def emitter(self) -> Emitter: ...  # dead letters, the feeds of admitted requests

    @property
    def dead(self) -> list[str]: ...  # consumers of its own name known gone (`workers.slot`)

    @property
    def metrics(self) -> WorkerMetrics: ...

    @property
    def admissions(self) -> queue.Queue[Admission]: ...  # to the compute loop

    @property
    def stop_event(self) -> threading.Event: ...


def read_loop(w: ReaderHost) -> None:
    """The reader thread: new entries and claims of dead consumers' ones -> admissions.

    After any error (a lost XREADGROUP, claim or admission reply leaves entries pending under
    this live consumer, which nobody claims) it first takes back the entries pending under its
    own consumer that it does not hold (`take_back`), then reads new ones again."""
    last_claim = 0.0
    claim_every = max(0.2, w.config.lease_ms / 4000)
    recover: str | None = None  # after an error: the entry id to take back entries after
    while not w.stop_event.is_set():
        try:
            room = w.room()
            if w.heartbeat.draining:
                time.sleep(w.config.block_ms / 1000)
                continue
            if room <= 0:
                if not displace(w, room):
                    time.sleep(min(w.config.block_ms / 1000, DISPLACE_POLL_S))
                continue
            if recover is not None:
                recover = take_back(w, recover, room)
                continue
            now = time.monotonic()
            # under the streams' lock: an entry read under one consumer name is admitted
            # under it (a rejoin waits)
            if now - last_claim >= claim_every:
                last_claim = now
                with w.streams.lock:
                    claimed = w.streams.claim(w.stream, w.group, w.config.lease_ms, room, w.dead)
                    if claimed:
                        receive(w, claimed, claimed=True)
                room = w.room()
                if room <= 0:
                    continue
            count = min(room, w.config.read_batch)
            with w.streams.lock:
                # the best of the wait set first (--scheduling-policy priority: lua/refill.lua)
                w.streams.refill(w.stream, w.group, count)
                entries = w.streams.read(w.stream, w.group, count, w.config.block_ms)
                if entries:
                    receive(w, entries)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            logger.warning("reader: redis unavailable (%s); retrying", exc)
            recover = "-"
            time.sleep(0.5)
        except Exception:  # never let one bad entry or reply stop the reader
            logger.exception("reader loop error")
            recover = "-"
            time.sleep(0.1)


def displace(w: ReaderHost, room: int) -> bool:
    """A full worker still takes a request of a better priority than the worst it holds, or
    of that priority and another tenant than the one crowding its slots, when one waits (the
    scheduler then preempts a running sequence for it: engine/scheduler.py), up to twice its
    sequences; whether it took one."""
    crowding = w.inflight.crowding()
    if crowding is None or room <= -w.config.engine.max_num_seqs:
        return False
    worst, crowded = crowding
    with w.streams.lock:
        # every unread entry when one qualifies: they wait unread only while every worker is
        # full, so taking the others along costs no other worker anything
        count = w.streams.refill(w.stream, w.group, 1, below=worst, crowded=crowded)
        if not count:
            return False
        entries = w.streams.read(w.stream, w.group, count, None)
        if entries:
            receive(w, entries)
    return bool(entries)


def take_back(w: ReaderHost, after: str, room: int) -> str | None:
    """Admit up to `room` entries pending under this worker's consumer, with ids after
    `after`, that it does not hold (delivered or claimed by a call whose reply was lost, or
    read and not admitted); where to go on from, None when all were seen. Entries it holds, or
    whose final write it keeps for a failover's repair (`Emitter.retained`), are skipped."""
    with w.streams.lock:
        # what it holds, read before the pending list: an entry let go after this is acked
        skip = set(w.inflight.snapshot().values()) | w.emitter.retained()
        batch = max(room, w.config.read_batch)
        found = w.streams.own(w.stream, w.group, after, batch)
        unheld = [e for e in found if e.entry_id not in skip]
        mine = unheld[:room]
        if mine:
            logger.warning(
                "reader: consumer %s takes back %d pending entries it did not hold",
                w.streams.consumer,
                len(mine),
            )
            receive(w, mine)
    if len(mine) < len(unheld):  # no room for the others yet
        return mine[-1].entry_id
    return found[-1].entry_id if len(found) == batch else None


def receive(w: ReaderHost, entries: list[Entry], claimed: bool = False) -> None:
    """Validate entries (poison -> DLQ), admit the rest in one script call (this worker
    becomes their owner), learn what was emitted, queue them for the compute loop."""
    taken: list[tuple[Entry, Task, int]] = []
    queued = 0
    try:
        for entry in entries:
            valid = _validate(w, entry)
            if valid is not None:
                taken.append((entry, *valid))
        if not taken:
            return
        found = w.streams.admit([_admit_args(w, e, task, claimed) for e, task, _ in taken])
        for (entry, task, strikes), admitted in zip(taken, found, strict=True):
            admission = _admission(w, entry, task, claimed, admitted, strikes)
            if admission is not None:
                w.admissions.put(admission)
            queued += 1
    except BaseException:
        # not queued for admission: forget them, so that the reader takes them back
        for entry, task, _ in taken[queued:]:
            w.inflight.remove(task.request_id, entry.entry_id)
        raise


def _validate(w: ReaderHost, entry: Entry) -> tuple[Task, int] | None:
    """The entry's task, now held by this worker, and its strikes; None when it went to the
    DLQ or is ours."""
    if entry.payload is None:
        dead_letter(w, entry, "entry has no 'm' field", "")
        return None
    try:
        task = w.message.decode(entry.payload)
    except MessageError as exc:
        dead_letter(w, entry, f"invalid {w.role} task: {exc}", "")
        return None
    grammar_error = _compile_grammar(w, task)
    if grammar_error is not None:
        dead_letter(w, entry, grammar_error, task.request_id)
        return None
    queued = len(getattr(task, "output_token_ids", ()))
    if w.inflight.get(task.request_id) is not None:
        # running here already: our own entry again (released, then claimed back); a live
        # holder is no crash, so this delivery is no strike
        w.streams.strikes(task.request_id, entry.entry_id, entry.deliveries, queued, alive=True)
        return None
    strikes = 0
    if entry.deliveries > 1:
        # Poison is an entry whose holders die (or wedge) running it before it makes progress;
        # a request that emitted tokens since its last claim is churn, however often it was
        # claimed, and so is one whose holders died before they began running it.
        strikes = w.streams.strikes(task.request_id, entry.entry_id, entry.deliveries, queued)
        if strikes >= w.config.max_deliveries:
            reason = (
                f"delivered {entry.deliveries} times, {strikes} times its holder died running "
                f"it without progress (limit {w.config.max_deliveries})"
            )
            dead_letter(w, entry, reason, task.request_id)
            return None
    w.inflight.add(task.request_id, entry.entry_id, task.priority, task.tenant, task.weight)
    return task, strikes


def _admit_args(
    w: ReaderHost, entry: Entry, task: Task, claimed: bool
) -> tuple[str, str, int, dict[str, str | int | float]]:
    status = RequestStatus.PREFILLING if w.role == Stage.PREFILL else RequestStatus.DECODING
    now = time.time()
    first_stage = w.role == Stage.PREFILL or not getattr(task, "prefilled", True)
    started = first_stage and entry.deliveries == 1 and not claimed
    record = RequestRecord(
        status=status,
        stage=w.role,
        owner=w.name,
        updated=now,
        started=now if started else None,  # the ingress's queue-time metric
    )
    queued = len(getattr(task, "output_token_ids", ()))
    fields = record.changes(places={rec.UPDATED: rec.MILLIS, rec.STARTED: rec.MILLIS})
    return entry.entry_id, task.request_id, queued, fields


def _admission(
    w: ReaderHost, entry: Entry, task: Task, claimed: bool, found: Admitted, strikes: int
) -> Admission | None:
    """What the engine needs to go on; None when nothing is left to do."""
    queued = list(getattr(task, "output_token_ids", ()))
    if found.ended:  # ended before this delivery (its final write landed): only the ack is left
        w.r.xack(w.stream, w.group, entry.entry_id)
        w.inflight.remove(task.request_id, entry.entry_id)
        return None
    text_len: int | None = None
    emitted = queued
    if claimed or entry.deliveries > 1 or found.emitted != len(queued):
        try:
            chunks = w.streams.history(task.request_id)
            emitted, text_len, finished = emitted_of(chunks, task.request_id)
        except (MessageError, ValueError) as exc:
            w.inflight.remove(task.request_id, entry.entry_id)
            dead_letter(w, entry, f"corrupt output stream: {exc}", task.request_id)
            return None
        if finished:
            w.r.xack(w.stream, w.group, entry.entry_id)
            w.inflight.remove(task.request_id, entry.entry_id)
            return None
        logger.info(
            "request %s: claimed entry %s (delivery %d, %d strikes) with %d tokens already emitted",
            task.request_id,
            entry.entry_id,
            entry.deliveries,
            strikes,
            len(emitted),
        )
    w.emitter.follow(task.request_id, found.feeds)
    generation = w.streams.generation
    return Admission(
        entry.entry_id,
        task,
        emitted,
        found.cancelled,
        text_len,
        generation,
        w.shard,
        suspect=strikes > 0,
        delivery=entry.deliveries,
    )


def _compile_grammar(w: ReaderHost, task: Task) -> str | None:
    """Compile a structured-output task's grammar here, on the reader thread, so that its
    admission finds it in the engine's cache (the compute loop never compiles); the reason to
    dead-letter the entry when it has none."""
    if task.sampling.structured is None:
        return None
    try:
        w.engine.grammars.compile(task.sampling.structured)
    except InvalidRequestError as exc:
        return f"rejected by the engine: {exc}"
    return None


def dead_letter(w: ReaderHost, entry: Entry, reason: str, request_id: str) -> None:
    w.metrics.dead_letters.inc()
    w.emitter.put(
        Outgoing(
            OutgoingKind.DEAD_LETTER,
            request_id,
            entry.entry_id,
            payload=entry.payload or b"",
            reason=reason,
            generation=w.streams.generation,
        )
    )
