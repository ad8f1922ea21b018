"""Redis stream delivery for workers (sync redis-py): groups, reads, claims and fenced Lua writes.

A worker's writes for one engine step are one Lua call (`step`), fenced per worker: a claim
(`claim`, only of consumers silent for a lease: leases are heartbeats, `beat`) marks the dead
consumer fenced, and the step script refuses every step of a fenced consumer wholesale, so a
worker whose entries were claimed drops everything and comes back as a new consumer
(`rejoin`) instead of duplicating. Each step carries a number: a retried step whose reply was
lost is not applied twice. Cancels and feed changes reach the owner through its control list,
returned by each step. Dead-lettering and release check ownership in the stream's pending list
itself. docs/internals.md "Queue plane".
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import redis

from kvrelay.core import record as rec
from kvrelay.core.enums import FinishReason, WorkerField
from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import TokenChunk, decode_chunks, frame
from kvrelay.core.record import RequestRecord, as_str
from kvrelay.core.usage import USAGE_TTL_S
from kvrelay.core.worker_record import WorkerRecord
from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.field_ttl import field_ttl_sync
from kvrelay.pipeline.queue.progress import FEED_SEP, feed_item, tail_entry
from kvrelay.pipeline.queue.replies import StreamReply

logger = logging.getLogger(__name__)


class StepStatus(enum.IntEnum):
    """The step script's verdict on a whole step (`lua/step.lua`)."""

    FENCED = 0  # the consumer was fenced (its entries claimed): nothing written
    OK = 1
    REPEATED = 2  # this step number was written before (a retry whose reply was lost)
    # the server's fence is below the caller's last written step (`after`): it lost steps (a
    # failover to a replica without them, a restart): nothing written
    BEHIND = 3


@dataclass(slots=True)
class Entry:
    """One stream entry as delivered to this consumer; `payload` is None if the field is missing."""

    entry_id: str
    payload: bytes | None
    deliveries: int = 1


class WriteMode(enum.StrEnum):
    """What a step write does besides appending its chunk (the step script's `mode`)."""

    EMIT = "e"  # the chunk joins the request's tail (the step's field of the tail hash)
    FLUSH = "f"  # out:{id} gets the tail and the chunk
    DONE = "d"  # the final chunk: flush, ack the entry, write the record's end, drop progress
    HANDOFF = "h"  # queue the next stage's task and ack the entry


@dataclass(slots=True)
class StepWrite:
    """One sequence's part of a step: a chunk for the request held by entry `entry_id`."""

    entry_id: str
    request_id: str
    chunk: TokenChunk
    mode: WriteMode = WriteMode.EMIT
    next_payload: bytes = b""  # the next stage's task (HANDOFF)
    req_fields: dict[str, str | int | float] | None = None
    # FLUSH, DONE, HANDOFF: the framed tail and chunk for out:{id}
    history: bytes = b""
    payload: bytes = b""  # chunk.encode(), when the caller has it already


@dataclass(slots=True)
class StepResult:
    status: StepStatus
    cancelled: set[str] = field(default_factory=set)  # from the control list
    feeds: dict[str, list[str]] = field(default_factory=dict)  # request id -> its new feeds
    num_control: int = 0  # control items returned: the next step acks them


@dataclass(slots=True)
class Admitted:
    """A request's progress as the admission script found it."""

    emitted: int = 0  # at its last flush (the tail may hold more)
    cancelled: bool = False
    ended: str = ""  # the record's status when the request already ended (nothing to do)
    feeds: list[str] = field(default_factory=list)  # the output readers following it


def _flat(fields: dict[str, str | int | float] | None) -> list[str | int | float]:
    out: list[str | int | float] = []
    for key, value in (fields or {}).items():
        out += [key, value]
    return out


class Streams:
    """Stream operations for one consumer over a sync Redis client (binary responses)."""

    RELEASED = "released"  # the consumer released entries go to: it never beats (claimable)

    def __init__(
        self,
        client: redis.Redis | redis.cluster.RedisCluster,
        keys: Keys,
        consumer: str,
        *,
        out_ttl_s: int = 600,
        req_ttl_s: int = 86400,
        dlq_maxlen: int = 10000,
        usage_ttl_s: int = USAGE_TTL_S,
    ):
        self.r = client
        self.keys = keys
        # (consumer name, generation), swapped in one assignment by `rejoin`; the lock is held
        # while a batch is read and admitted, so no admission straddles a rejoin (the worker
        # drops what an older generation admitted)
        self.identity = (consumer, 0)
        self.lock = threading.RLock()
        # the consumer's admission count as the server last returned it (`lua/admit.lua`):
        # its steps pass it, and a server whose count is lower lost an admission (BEHIND)
        self.admitted = 0
        self._registered = ""  # the consumer whose first beat registered its fence key
        self.out_ttl_s = out_ttl_s
        self.req_ttl_s = req_ttl_s
        self.dlq_maxlen = dlq_maxlen
        self.usage_ttl_s = usage_ttl_s
        self._step = client.register_script(scripts.source("usage") + scripts.with_progress("step"))
        self._admit = client.register_script(scripts.with_progress("admit"))
        self._claim = client.register_script(scripts.source("claim"))
        self._beat = client.register_script(scripts.source("beat"))
        self._dead_letter = client.register_script(scripts.fenced("dead_letter"))
        self._strikes = client.register_script(scripts.with_progress("strikes"))
        self._ran = client.register_script(scripts.source("ran"))
        self._release = client.register_script(scripts.fenced("release"))
        self._prune = client.register_script(scripts.source("prune"))
        self._read = client.register_script(scripts.with_progress("attach"))
        self._own = client.register_script(scripts.source("own"))
        self._refill = client.register_script(scripts.ordered("refill"))

    @property
    def consumer(self) -> str:
        return self.identity[0]

    @property
    def generation(self) -> int:
        return self.identity[1]

    @property
    def ttl_fields(self) -> str:
        """ "1" when the server keeps per-field expiry (HSETEX), probed once per server."""
        return field_ttl_sync(self.r)

    @property
    def feed_prefix(self) -> str:
        return self.keys.feed("")

    # groups and reads
    def ensure_group(self, stream: str, group: str) -> None:
        """Create the group (and stream) reading from the start; an existing group is fine."""
        try:
            self.r.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, stream: str, group: str, count: int, block_ms: int | None) -> list[Entry]:
        """New entries for this consumer (XREADGROUP >); block_ms None = do not block."""
        reply = cast(
            "StreamReply | None",
            self.r.xreadgroup(group, self.consumer, {stream: ">"}, count=count, block=block_ms),
        )
        entries: list[Entry] = []
        for _name, items in reply or []:
            for entry_id, fields in items:
                entries.append(Entry(as_str(entry_id), (fields or {}).get(MESSAGE_FIELD)))
        return entries

    def refill(
        self, stream: str, group: str, count: int, below: int | None = None, crowded: str = ""
    ) -> int:
        """Move the best of `stream`'s wait set (--scheduling-policy priority) into it, so that
        `count` entries wait unread for this consumer's next read; with `below` (a full
        worker: the worst priority it holds), at most `count` of a priority below it, or of
        it and another tenant than `crowded` (the one holding most of its slots; "": none).
        How many entries to read: with `below`, every unread one when one of them qualifies,
        else 0 (`lua/refill.lua`)."""
        args: list[str | int] = [group, count, "" if below is None else below, crowded]
        return int(self._refill(keys=[stream], args=args))

    def own(self, stream: str, group: str, after: str, count: int) -> list[Entry]:
        """Up to `count` entries pending under this consumer with ids after `after` ('-': from
        the first), with their delivery counts, read without counting a delivery
        (`lua/own.lua`): after a Redis error its worker takes back what it does not hold."""
        reply = self._own(keys=[stream], args=[group, self.consumer, after, count])
        return [Entry(as_str(eid), payload or None, int(n)) for eid, payload, n in reply or []]

    def admitted_key(self, consumer: str | None = None) -> str:
        """String: a consumer's admission count (`admitted_key` in `lua/progress.lua`)."""
        return self.keys.progress.removesuffix("prog") + f"admitted:{consumer or self.consumer}"

    def admitted_on_server(self) -> int:
        """The server's admission count of this consumer (a repair's new baseline)."""
        return int(cast("bytes | None", self.r.get(self.admitted_key())) or 0)

    def claim(
        self, stream: str, group: str, lease_ms: int, count: int, dead: Sequence[str] = ()
    ) -> list[Entry]:
        """Take up to `count` entries of consumers whose worker has not beaten for a lease, or
        named in `dead` (known gone: see `workers.slot`) (`lua/claim.lua`); nothing is read
        per entry while every worker lives."""
        prefill = stream == self.keys.prefill_stream
        other = self.keys.decode_stream if prefill else self.keys.prefill_stream
        reply = self._claim(
            keys=[stream, self.keys.consumers, other],
            args=[
                group, self.consumer, lease_ms, count, self.keys.fence(""),
                DECODE_GROUP if prefill else PREFILL_GROUP, self.keys.tail(""), *dead,
            ],
        )  # fmt: skip
        return [Entry(as_str(eid), payload or None, int(n)) for eid, payload, n in reply or []]

    def beat(self, worker_key: str, fields: dict, ttl_s: int) -> tuple[bool, bool]:
        """Publish the worker hash and this consumer's beat (its lease; the first beat of a
        consumer registers its fence key); (the admin asked the worker to drain, the
        consumer is fenced: it beats no more)."""
        consumer = self.consumer
        first = "1" if self._registered != consumer else "0"
        drain, fenced = self._beat(
            keys=[worker_key, self.keys.consumers, self.keys.fence(consumer)],
            args=[ttl_s, consumer, first, *_flat(fields)],
        )
        self._registered = consumer
        return bool(drain), bool(fenced)

    def rejoin(self, fenced: str, consumer: str) -> bool:
        """Come back as `consumer` after `fenced` (this one's former name) was fenced: a new
        generation (what the old one held is dropped by the worker). False when done already."""
        with self.lock:
            if self.consumer != fenced:
                return False
            self.identity = (consumer, self.generation + 1)
            self.admitted = 0  # the new consumer's count starts at 0
            return True

    def strikes(
        self,
        request_id: str,
        entry_id: str,
        deliveries: int,
        queued_tokens: int,
        alive: bool = False,
    ) -> int:
        """How many holders of the entry died running it since it last made progress (new
        tokens emitted between two claims).

        `queued_tokens`: the tokens the task carried when queued (its first delivery's count);
        `alive`: the claimant already holds it, which proves no crash.
        Recorded in req:{id} (claim_entry, claim_emitted, claim_delivery, claim_strikes,
        claim_seen) at every claim; the first holder counts as running it, a later one only
        when it said so (`ran`)."""
        args: list[str | int] = [
            entry_id,
            deliveries,
            queued_tokens,
            "1" if alive else "0",
            request_id,
        ]
        keys = [self.keys.request(request_id), self.keys.progress]
        return int(self._strikes(keys=keys, args=args))

    def ran(self, request_id: str, entry_id: str, delivery: int) -> bool:
        """Record that this holder (of `delivery`) begins running the entry, a suspect, alone:
        its death from now on is a strike. False when the record counts no longer this entry."""
        keys = [self.keys.request(request_id)]
        return bool(self._ran(keys=keys, args=[entry_id, delivery]))

    def release(self, stream: str, group: str, entries: list[tuple[str, str]]) -> None:
        """Give (entry id, request id) pairs this consumer holds back, claimable at once: they
        go to the `released` consumer, which never beats, and their progress loses its owner.
        An entry another consumer has claimed is left alone."""
        if not entries:
            return
        args: list[str] = [group, self.consumer, self.ttl_fields, self.RELEASED]
        keys = [stream, self.keys.consumers, self.keys.progress]
        for entry_id, request_id in entries:
            args += [entry_id, request_id]
            keys.append(self.keys.out(request_id))
        self._release(keys=keys, args=args)

    # admission and the step's writes
    def admit(
        self, entries: list[tuple[str, str, int, dict[str, str | int | float]]]
    ) -> list[Admitted]:
        """Make this consumer the owner of each (entry id, request id, tokens the task carries,
        record fields) and write the record fields; what each request's progress holds."""
        if not entries:
            return []
        keys = [self.keys.progress]
        args: list[str | int | float] = [self.consumer, self.ttl_fields, len(entries)]
        for entry_id, request_id, queued, fields in entries:
            keys += [self.keys.request(request_id), self.keys.out(request_id)]
            flat = _flat(fields)
            args += [entry_id, request_id, queued, len(flat), *flat]
        consumer = self.consumer
        out = []
        *rows, admitted = self._admit(keys=keys, args=args)
        if self.consumer == consumer:  # (a rejoin meanwhile: the new consumer's starts at 0)
            self.admitted = max(self.admitted, int(admitted))
        for row in rows:
            if int(row[0]) < 0:
                out.append(Admitted(ended=as_str(row[1])))
            else:
                feeds = [f for f in as_str(row[2]).split(FEED_SEP) if f]
                out.append(Admitted(int(row[0]), bool(int(row[1])), feeds=feeds))
        return out

    def step(
        self,
        stream: str,
        group: str,
        next_stream: str,
        writes: list[StepWrite],
        feeds: Mapping[str, Sequence[str]],
        step_no: int,
        acked: int = 0,
        consumer: str | None = None,
        max_control: int = 256,
        drop_steps: Sequence[int] = (),
        after: int = 0,
        admitted: int = 0,
    ) -> StepResult:
        """One worker step in one script call (`lua/step.lua`), fenced per worker: refused
        wholesale once `consumer` (default: this one) is fenced; a repeated `step_no` writes
        nothing again. `feeds`: request id -> the feeds following it (each feed gets one entry
        for all its requests' chunks); `acked`: the control items the previous step returned;
        `drop_steps`: earlier steps whose tail field no request's tail needs any more;
        `after`: the last step number this consumer had written (BEHIND when the server's
        fence is below it; 0: no check); `admitted`: the consumer's admission count it knows
        (`Streams.admitted`; BEHIND when the server's is lower; 0: no check).
        A request id may appear once per call."""
        consumer = consumer or self.consumer
        tail: list[tuple[str, bytes]] = []  # (id, chunk) joining tails: the step's field
        by_feed: dict[str, list[bytes]] = {}  # feed -> framed (request id, chunk) pairs
        flushes: list[list] = []
        keys = [stream, next_stream, self.keys.progress, self.keys.fence(consumer)]
        keys += [self.keys.control(consumer), self.keys.tail(consumer)]
        stamp: rec.Encoded | None = None  # the step's `updated`, for the writes that set fields
        for w in writes:
            chunk = w.chunk
            payload = w.payload or chunk.encode()
            followers = feeds.get(w.request_id, ())
            if followers:
                framed = feed_item(w.request_id, payload)
                for feed in followers:
                    by_feed.setdefault(feed, []).append(framed)
            if w.mode == WriteMode.EMIT:
                tail.append((w.request_id, payload))
                continue
            keys += [self.keys.request(w.request_id), self.keys.out(w.request_id)]
            fields = w.req_fields
            if w.mode == WriteMode.DONE or fields:
                if stamp is None:
                    now = RequestRecord(updated=time.time())
                    stamp = now.changes(places={rec.UPDATED: rec.MILLIS})
                fields = {**stamp, **(fields or {})}
            flat = _flat(fields)
            flushes.append(
                [
                    w.request_id,
                    w.entry_id,
                    w.mode.value,
                    chunk.index + len(chunk.token_ids),
                    w.history or frame(payload),  # a flush with no tail before the chunk
                    w.next_payload,
                    len(flat),
                    *flat,
                ]
            )
        args: list = [
            group,
            self.feed_prefix,
            self.ttl_fields,
            self.out_ttl_s,
            self.req_ttl_s,
            consumer,
            step_no,
            acked,
            max_control,
            tail_entry(tail) if tail else b"",
            len(by_feed),
            len(flushes),
            len(drop_steps),
            after,
            admitted,
            self.usage_ttl_s,
            *drop_steps,
        ]
        for feed, items in by_feed.items():
            args += [feed, b"".join(items)]
        for one in flushes:
            args += one
        status, control = self._step(keys=keys, args=args)
        result = StepResult(StepStatus(int(status)), num_control=len(control))
        for raw in control:
            kind, _, rest = as_str(raw).partition(" ")
            request_id, _, value = rest.partition(" ")
            if kind == "cancel":
                result.cancelled.add(request_id)
            elif kind == "feeds":
                result.feeds[request_id] = [f for f in value.split(FEED_SEP) if f]
        return result

    def dead_letter(
        self,
        stream: str,
        group: str,
        entry_id: str,
        payload: bytes | None,
        reason: str,
        request_id: str = "",
    ) -> str | None:
        """Move an entry to the DLQ with its reason and ack it; end the request's output."""
        chunk_payload, index = b"", 0
        if request_id:
            index = self.emitted(request_id)
            chunk = TokenChunk(index=index, finish_reason=FinishReason.ERROR, error=reason)
            chunk_payload = chunk.encode()
        req_key = self.keys.request(request_id) if request_id else self.keys.dlq
        out_key = self.keys.out(request_id) if request_id else self.keys.dlq
        reply = self._dead_letter(
            keys=[stream, self.keys.dlq, req_key, out_key, self.keys.progress],
            args=[
                group,
                self.consumer,
                entry_id,
                payload or b"",
                reason,
                request_id,
                chunk_payload,
                index,
                self.out_ttl_s,
                f"{time.time():.3f}",
                self.dlq_maxlen,
                self.feed_prefix,
            ],
        )
        if reply in (0, b"0"):
            return None
        logger.warning(
            "dead-lettered %s entry %s (request %s): %s",
            stream,
            entry_id,
            request_id or "?",
            reason,
        )
        return as_str(reply)

    # reads of request state
    def emitted(self, request_id: str) -> int:
        """Tokens emitted so far: out:{id} and the tail, or the record's count when they are
        gone (a rare path: dead letters)."""
        chunks = self.history(request_id)
        if chunks:
            return chunks[-1].index + len(chunks[-1].token_ids)
        raw = self.r.hget(self.keys.request(request_id), rec.EMITTED)
        return RequestRecord.decode_fields((rec.EMITTED,), (raw,)).emitted or 0

    def history(self, request_id: str) -> list[TokenChunk]:
        """Everything emitted, in order, read in one step (`lua/attach.lua`, following
        nothing): out:{id}, then the tail in its owner's tail hash."""
        _raw, runs, tail = self._read(
            keys=[self.keys.progress, self.keys.out(request_id)],
            args=[request_id, "", 0, self.ttl_fields],
        )
        chunks = [c for run in runs for c in decode_chunks(run)]
        return chunks + [TokenChunk.decode(payload) for payload in tail]

    def emitted_tokens(self, request_id: str) -> tuple[list[int], int, bool]:
        """What was emitted (out:{id} then the tail): the token ids in order, the length of
        their text in characters, and whether a final chunk was written."""
        return emitted_of(self.history(request_id), request_id)

    def trim_acked(self, stream: str, group: str) -> int:
        """Drop entries every consumer is done with (older than the oldest pending/undelivered)."""
        summary = self.r.xpending(stream, group)
        groups = {as_str(g["name"]): g for g in self.r.xinfo_groups(stream)}
        info = groups.get(group)
        if info is None:
            return 0
        floor = as_str(info["last-delivered-id"])
        if summary and summary.get("pending"):
            floor = min(floor, as_str(summary["min"]), key=_id_tuple)
        if floor == "0-0":
            return 0
        # MINID keeps entries >= floor; the last delivered one is kept, which is harmless
        return int(self.r.xtrim(stream, minid=floor, approximate=False))

    def live_consumers(self) -> set[str]:
        """Consumer names the live workers publish in their worker:{name} hashes."""
        pipe = self.r.pipeline(transaction=False)
        for key in self.r.scan_iter(match=self.keys.worker_pattern, count=1000):
            pipe.hget(key, WorkerField.CONSUMER)
        records = (WorkerRecord.partial(WorkerField.CONSUMER, v) for v in pipe.execute())
        return {w.consumer for w in records if w.consumer}

    def prune_consumers(
        self, stream: str, group: str, idle_ms: int = 600_000, dead_idle_ms: int = 30_000
    ) -> int:
        """Delete consumers that own nothing and were idle `dead_idle_ms` while no live worker
        names them (a restart makes a new consumer), or `idle_ms` in any case. A consumer that
        owns entries but never beat (it died between its read and its first heartbeat) gets a
        beat of 0 in the consumers hash: the next claim scan takes its entries."""
        live = self.live_consumers()
        beating = {as_str(name) for name in self.r.hkeys(self.keys.consumers)}
        removed = 0
        for info in self.r.xinfo_consumers(stream, group):
            name = as_str(info["name"])
            if info["pending"] and name not in beating and name not in live:
                self.r.hsetnx(self.keys.consumers, name, 0)
            if name == self.consumer or info["pending"]:
                continue  # entries of a dead consumer are claimed after the lease; prune later
            if info["idle"] > (idle_ms if name in live else min(idle_ms, dead_idle_ms)):
                keys = [stream, self.keys.fence(name), self.keys.tail(name)]
                keys.append(self.admitted_key(name))
                pruned = self._prune(keys=keys, args=[group, name])
                removed += int(pruned == 0)
        return removed


def emitted_of(chunks: list[TokenChunk], request_id: str) -> tuple[list[int], int, bool]:
    """(token ids, text length in characters, whether a final chunk is among them) of a
    request's chunks in order; ValueError when their indices leave a gap or overlap."""
    tokens: list[int] = []
    text_len = 0
    finished = False
    for chunk in chunks:
        if chunk.index != len(tokens):
            raise ValueError(f"out:{request_id} has a gap at index {len(tokens)}")
        tokens.extend(chunk.token_ids)
        text_len += len(chunk.text)
        finished = finished or chunk.finished
    return tokens, text_len, finished


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
