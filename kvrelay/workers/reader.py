"""The reader thread of a worker: XREADGROUP new entries, XAUTOCLAIM entries whose lease ran
out, poll cancel flags; validated tasks go to the compute loop's admission queue, poison to the
DLQ (through the emitter, so writes stay in order)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from kvrelay.core import record as rec
from kvrelay.core.enums import RequestStatus, Stage
from kvrelay.core.messages import MessageError, Task
from kvrelay.pipeline.queue.streams import Entry
from kvrelay.workers.emitter import Outgoing, OutgoingKind
from kvrelay.workers.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvrelay.workers.base import Worker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Admission:
    entry_id: str
    task: Task
    emitted: list[int]  # tokens already in out:{id}
    cancelled: bool = False
    emitted_text_len: int | None = None  # characters in out:{id} (None: all of `emitted`'s)


def read_loop(w: Worker) -> None:
    """The reader thread: new entries, claims of idle ones, cancel flags -> worker queues."""
    cursor, last_claim, last_cancel = "0-0", 0.0, 0.0
    claim_every = max(0.2, w.config.lease_ms / 4000)
    while not w.stop_event.is_set():
        try:
            now = time.monotonic()
            if now - last_cancel >= w.config.cancel_poll_s:
                last_cancel = now
                for rid in w.streams.cancelled(list(w.inflight.snapshot())):
                    w.cancels.put(rid)
            room = w.config.max_num_seqs - len(w.inflight)
            if w.heartbeat.draining or room <= 0:
                time.sleep(w.config.block_ms / 1000)
                continue
            if now - last_claim >= claim_every:
                last_claim = now
                cursor, entries = w.streams.claim(
                    w.stream, w.group, w.config.lease_ms, room, cursor
                )
                for entry in entries:
                    receive(w, entry, claimed=True)
                room = w.config.max_num_seqs - len(w.inflight)
                if room <= 0:
                    continue
            count = min(room, w.config.read_batch)
            for entry in w.streams.read(w.stream, w.group, count, w.config.block_ms):
                receive(w, entry)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            logger.warning("reader: redis unavailable (%s); retrying", exc)
            time.sleep(0.5)
        except Exception:  # never let one bad entry or reply stop the reader
            logger.exception("reader loop error")
            time.sleep(0.1)


def receive(w: Worker, entry: Entry, claimed: bool = False) -> None:
    """Validate one entry (poison -> DLQ), learn what was emitted, queue it for admission."""
    if entry.payload is None:
        return dead_letter(w, entry, "entry has no 'm' field", "")
    try:
        task = w.message.decode(entry.payload)
    except MessageError as exc:
        return dead_letter(w, entry, f"invalid {w.role} task: {exc}", "")
    grammar_error = _compile_grammar(w, task)
    if grammar_error is not None:
        return dead_letter(w, entry, grammar_error, task.request_id)
    queued = len(getattr(task, "output_token_ids", ()))
    if w.inflight.get(task.request_id) is not None:
        # running here already: our own entry, re-claimed because a renewal came late; a live
        # holder is no crash, so this delivery is no strike
        w.streams.strikes(task.request_id, entry.entry_id, entry.deliveries, queued, alive=True)
        return
    if entry.deliveries > 1:
        # Poison is an entry whose holders die (or wedge) before it makes progress; a request
        # that emitted tokens since its last claim is churn, however often it was claimed.
        strikes = w.streams.strikes(task.request_id, entry.entry_id, entry.deliveries, queued)
        if strikes >= w.config.max_deliveries:
            reason = (
                f"delivered {entry.deliveries} times, {strikes} times in a row without "
                f"progress (limit {w.config.max_deliveries})"
            )
            return dead_letter(w, entry, reason, task.request_id)
    w.inflight.add(task.request_id, entry.entry_id)
    try:
        admission = _admission(w, entry, task, claimed)
    except BaseException:
        # not queued for admission: stop renewing the lease so the entry is claimed again
        w.inflight.remove(task.request_id, entry.entry_id)
        raise
    if admission is not None:
        w.admissions.put(admission)


def _admission(w: Worker, entry: Entry, task: Task, claimed: bool) -> Admission | None:
    """Read what out:{id} holds, mark the request as ours; None when nothing is left to do."""
    text_len: int | None = None
    try:
        if claimed or entry.deliveries > 1:
            emitted, text_len, finished = w.streams.emitted_tokens(task.request_id)
        else:  # first delivery: out:{id} holds exactly what the task says (saves a round trip;
            # were it otherwise, the fenced emit refuses and the entry is claimed and re-read)
            emitted, finished = list(getattr(task, "output_token_ids", ())), False
    except (MessageError, ValueError) as exc:
        w.inflight.remove(task.request_id, entry.entry_id)
        dead_letter(w, entry, f"corrupt output stream: {exc}", task.request_id)
        return None
    if finished:  # finished by a worker whose final write landed: only the ack is left
        w.r.xack(w.stream, w.group, entry.entry_id)
        w.inflight.remove(task.request_id, entry.entry_id)
        return None
    key = w.keys.request(task.request_id)
    pipe = w.r.pipeline(transaction=False)
    status = RequestStatus.PREFILLING if w.role == Stage.PREFILL else RequestStatus.DECODING
    pipe.hset(key, mapping={rec.STATUS: status, rec.STAGE: w.role, rec.OWNER: w.name})
    pipe.hsetnx(key, rec.STARTED, f"{time.time():.3f}")  # the ingress's queue-time metric
    pipe.exists(w.keys.cancel(task.request_id))
    cancelled = bool(pipe.execute()[-1])
    if claimed:
        logger.info(
            "request %s: claimed entry %s (delivery %d) with %d tokens already emitted",
            task.request_id,
            entry.entry_id,
            entry.deliveries,
            len(emitted),
        )
    return Admission(entry.entry_id, task, emitted, cancelled, text_len)


def _compile_grammar(w: Worker, task: Task) -> str | None:
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


def dead_letter(w: Worker, entry: Entry, reason: str, request_id: str) -> None:
    w.metrics.dead_letters.inc()
    w.emitter.put(
        Outgoing(
            OutgoingKind.DEAD_LETTER,
            request_id,
            entry.entry_id,
            payload=entry.payload or b"",
            reason=reason,
        )
    )
