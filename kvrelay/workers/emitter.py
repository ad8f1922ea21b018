"""The IO side of a worker: items the compute loop hands to the emitter thread, and the
heartbeat (worker hash with TTL, served models, lease renewal, drain flag, stream trimming).

Compute never waits on Redis: it puts `Outgoing` items on a queue.Queue and one emitter thread
writes them in order (pipelined fenced Lua calls), reporting refused writes back as lost.
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
from dataclasses import dataclass, field

import redis

from kvrelay.core.enums import WorkerField
from kvrelay.pipeline.queue.streams import Emission, FenceStatus, Streams
from kvrelay.workers.publication import ModelPublication

logger = logging.getLogger(__name__)


class OutgoingKind(enum.StrEnum):
    """What an `Outgoing` item writes."""

    EMIT = "emit"  # a chunk to out:{id} (fenced)
    HANDOFF = "handoff"  # a chunk and the next stage's task (fenced)
    DEAD_LETTER = "dead_letter"  # the entry to the DLQ (fenced)
    RELEASE = "release"  # the entry back to the group, claimable at once


@dataclass(slots=True)
class Outgoing:
    """One write for the emitter: a chunk, a hand-off (chunk + next task) or a dead letter."""

    kind: OutgoingKind
    request_id: str
    entry_id: str
    emission: Emission | None = None
    next_stream: str = ""
    payload: bytes = b""
    reason: str = ""
    req_fields: dict[str, str | int | float] = field(default_factory=dict)
    done: bool = False  # the entry is finished (acked) once this write succeeds


class Emitter:
    """Writes Outgoing items in order from its own thread; refused requests go to `lost`."""

    def __init__(
        self, streams: Streams, stream: str, group: str, inflight: Inflight, lease_ms: int = 0
    ):
        self.streams, self.stream, self.group = streams, stream, group
        self.lease_ms = lease_ms  # a released entry looks idle this long: claimable at once
        self.inflight = inflight
        self.queue: queue.Queue[Outgoing | None] = queue.Queue()
        self.lost: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="emitter", daemon=True)

    def put(self, item: Outgoing) -> None:
        self.queue.put(item)

    def close(self, timeout: float = 10.0) -> None:
        """Flush everything queued, then stop the thread."""
        self.queue.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            items = [self.queue.get()]
            while len(items) < 256:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            if items[-1] is None or None in items:
                stopping = True
                items = [i for i in items if i is not None]
            try:
                self._write(items)
            except Exception:  # the emitter must outlive any one bad write
                logger.exception("emitter: dropping %d writes", len(items))
                for item in items:
                    self.inflight.remove(item.request_id, item.entry_id)
                    self.lost.put(item.request_id)

    def _write(self, items: list[Outgoing]) -> None:
        while items:
            try:
                self._write_once(items)
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Valkey restarting: retry; the writes are fenced, so a repeat cannot duplicate
                logger.warning("emitter: redis unavailable (%s); retrying", exc)
                time.sleep(0.5)

    def _write_once(self, items: list[Outgoing]) -> None:
        batch: list[Outgoing] = []
        for item in items:
            if item.kind == OutgoingKind.EMIT:
                batch.append(item)
                continue
            self._flush(batch)
            batch = []
            if item.kind == OutgoingKind.HANDOFF:
                res = self.streams.handoff(
                    self.stream,
                    self.group,
                    item.entry_id,
                    item.next_stream,
                    item.request_id,
                    item.payload,
                    item.emission.chunk if item.emission else None,
                    item.req_fields,
                )
                self._settle(item, res.status, res.emitted)
            elif item.kind == OutgoingKind.RELEASE:  # after the writes queued before it
                self.streams.release(self.stream, self.group, [item.entry_id], self.lease_ms)
                self.inflight.remove(item.request_id, item.entry_id)
            else:
                self.streams.dead_letter(
                    self.stream,
                    self.group,
                    item.entry_id,
                    item.payload,
                    item.reason,
                    item.request_id,
                )
                self.inflight.remove(item.request_id, item.entry_id)
        self._flush(batch)
        del items[:]

    def _flush(self, batch: list[Outgoing]) -> None:
        if not batch:
            return
        results = self.streams.emit_many([b.emission for b in batch])
        for item, res in zip(batch, results, strict=True):
            self._settle(item, res.status, res.emitted)

    def _settle(self, item: Outgoing, status: FenceStatus, emitted: int) -> None:
        chunk = item.emission.chunk if item.emission else None
        landed = chunk and emitted >= chunk.index + len(chunk.token_ids)
        if status == FenceStatus.INDEX_MISMATCH and landed:
            # our own write that landed before a connection error: already done
            status = FenceStatus.OK
        if status == FenceStatus.OK:
            if item.done:
                self.inflight.remove(item.request_id, item.entry_id)
            return
        at = f"chunk at token {chunk.index}" if chunk else item.kind
        if status == FenceStatus.INDEX_MISMATCH:  # `emitted`: the count out:{id} holds
            why = f"index-mismatch: {at}, {emitted} tokens already emitted"
        else:  # not-owner: the script stops at the fence, so it reports no token count
            why = f"not-owner: entry {item.entry_id} was claimed by another worker; {at}"
        logger.warning("request %s: write refused (%s); dropping it", item.request_id, why)
        self.inflight.remove(item.request_id, item.entry_id)
        self.lost.put(item.request_id)


class Inflight:
    """Entries this worker owns (request id -> entry id), shared by the IO threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, str] = {}

    def add(self, request_id: str, entry_id: str) -> bool:
        with self._lock:
            if request_id in self._entries:
                return False
            self._entries[request_id] = entry_id
            return True

    def remove(self, request_id: str, entry_id: str | None = None) -> None:
        with self._lock:
            if entry_id is None or self._entries.get(request_id) == entry_id:
                self._entries.pop(request_id, None)

    def get(self, request_id: str) -> str | None:
        with self._lock:
            return self._entries.get(request_id)

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class Heartbeat:
    """Publishes worker:{name} (with TTL) and the served model (`ModelPublication`: numbers,
    defaults, tokenizer files); renews leases; reads `drain`."""

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
        info: dict[str, str],
        publication: ModelPublication | None,
        stats=lambda: {},
    ):
        self.streams, self.name, self.role = streams, name, role
        self.stream, self.group, self.inflight = stream, group, inflight
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self.info, self.publication, self.stats = info, publication, stats
        self.draining = False
        self.lost: queue.Queue[str] = queue.Queue()
        self._stop = threading.Event()
        self._last_trim = float("-inf")  # trim and prune on the first beat after a (re)start
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def beat(self) -> None:
        """One heartbeat: publish, renew leases, read the drain flag (raises on Redis errors)."""
        r, key = self.streams.r, self.streams.keys.worker(self.name)
        self.draining = r.hget(key, WorkerField.DRAIN) not in (None, b"", b"0")
        fields = {
            WorkerField.NAME: self.name,
            WorkerField.ROLE: self.role,
            WorkerField.HOST: socket.gethostname(),
            WorkerField.PID: os.getpid(),
            WorkerField.CONSUMER: self.streams.consumer,
            WorkerField.UPDATED: f"{time.time():.3f}",
            WorkerField.LOAD: len(self.inflight),
            WorkerField.DRAINING: int(self.draining),
            **self.info,
            **{k: str(v) for k, v in self.stats().items()},
        }
        pipe = r.pipeline(transaction=False)
        pipe.hset(key, mapping=fields)
        pipe.expire(key, self.ttl_s)
        pipe.execute()
        if self.publication is not None:
            self.publication.publish(r, self.streams.keys)
        owned = self.inflight.snapshot()
        by_entry = {eid: rid for rid, eid in owned.items()}
        for eid in self.streams.renew(self.stream, self.group, list(by_entry)):
            logger.warning("request %s: entry %s was claimed by another worker", by_entry[eid], eid)
            self.inflight.remove(by_entry[eid], eid)
            self.lost.put(by_entry[eid])
        if time.monotonic() - self._last_trim > 30:
            self._last_trim = time.monotonic()
            self.streams.trim_acked(self.stream, self.group)
            self.streams.prune_consumers(self.stream, self.group)

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
