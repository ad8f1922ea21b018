"""Redis stream delivery for workers (sync redis-py): groups, reads, claims and fenced Lua writes.

Every write that moves a request forward (token emission, hand-off, dead-lettering) is one Lua
script that first checks, with `XPENDING stream group id id 1`, that the calling consumer still
owns the entry; emission also checks the chunk index against the tokens already emitted. A
consumer whose entry was claimed by another worker is therefore refused instead of duplicating.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

import redis

from kvrelay.core import record as rec
from kvrelay.core.enums import FinishReason, WorkerField
from kvrelay.core.keys import MESSAGE_FIELD, Keys
from kvrelay.core.messages import TokenChunk
from kvrelay.core.record import as_str
from kvrelay.pipeline.queue import scripts

logger = logging.getLogger(__name__)


class FenceStatus(enum.StrEnum):
    """The outcome of a fenced write (the Lua scripts' replies, see `_fenced`)."""

    OK = "ok"
    NOT_OWNER = "not-owner"  # the entry was claimed by another consumer
    INDEX_MISMATCH = "index-mismatch"  # the chunk does not start at the tokens emitted


@dataclass(slots=True)
class Entry:
    """One stream entry as delivered to this consumer; `payload` is None if the field is missing."""

    entry_id: str
    payload: bytes | None
    deliveries: int = 1


@dataclass(slots=True)
class FencedResult:
    """Outcome of a fenced write."""

    status: FenceStatus
    emitted: int = 0  # tokens emitted after the write (or currently, on a mismatch)
    new_entry_id: str = ""

    @property
    def ok(self) -> bool:
        return self.status == FenceStatus.OK


@dataclass(slots=True)
class Emission:
    """A chunk to append to out:{request_id} for the work-stream entry `entry_id`."""

    stream: str
    group: str
    entry_id: str
    request_id: str
    chunk: TokenChunk
    req_fields: dict[str, str | int | float] | None = None


def _flat(fields: dict[str, str | int | float] | None) -> list[str | int | float]:
    out: list[str | int | float] = []
    for key, value in (fields or {}).items():
        out += [key, value]
    return out


def _fenced(reply: list) -> FencedResult:
    code = int(reply[0])
    if code == 1:
        value = reply[1]
        if isinstance(value, bytes | str):
            return FencedResult(FenceStatus.OK, new_entry_id=as_str(value))
        return FencedResult(FenceStatus.OK, emitted=int(value))
    if code == 0:
        return FencedResult(FenceStatus.NOT_OWNER)
    return FencedResult(FenceStatus.INDEX_MISMATCH, emitted=int(reply[1]))


class Streams:
    """Stream operations for one consumer over a sync Redis client (binary responses)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        consumer: str,
        *,
        out_ttl_s: int = 600,
        req_ttl_s: int = 86400,
        dlq_maxlen: int = 10000,
    ):
        self.r = client
        self.keys = keys
        self.consumer = consumer
        self.out_ttl_s = out_ttl_s
        self.req_ttl_s = req_ttl_s
        self.dlq_maxlen = dlq_maxlen
        self._emit = client.register_script(scripts.fenced("emit"))
        self._handoff = client.register_script(scripts.fenced("handoff"))
        self._dead_letter = client.register_script(scripts.fenced("dead_letter"))
        self._renew = client.register_script(scripts.fenced("renew"))
        self._strikes = client.register_script(scripts.fenced("strikes"))
        self._release = client.register_script(scripts.fenced("release"))
        self._prune = client.register_script(scripts.source("prune"))

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
        reply = self.r.xreadgroup(group, self.consumer, {stream: ">"}, count=count, block=block_ms)
        entries: list[Entry] = []
        for _name, items in reply or []:
            for entry_id, fields in items:
                entries.append(Entry(as_str(entry_id), (fields or {}).get(MESSAGE_FIELD)))
        return entries

    def claim(
        self, stream: str, group: str, min_idle_ms: int, count: int, cursor: str = "0-0"
    ) -> tuple[str, list[Entry]]:
        """XAUTOCLAIM entries idle longer than the lease; returns (next cursor, entries)."""
        reply = self.r.xautoclaim(stream, group, self.consumer, min_idle_ms, cursor, count=count)
        next_cursor, items = as_str(reply[0]), reply[1]
        entries = [
            Entry(as_str(eid), (fields or {}).get(MESSAGE_FIELD)) for eid, fields in items if eid
        ]
        if entries:
            counts = self.deliveries(stream, group, [e.entry_id for e in entries])
            for entry in entries:
                entry.deliveries = counts.get(entry.entry_id, 1)
        return next_cursor, entries

    def deliveries(self, stream: str, group: str, entry_ids: list[str]) -> dict[str, int]:
        """How many times each pending entry has been delivered."""
        pipe = self.r.pipeline(transaction=False)
        for eid in entry_ids:
            pipe.xpending_range(stream, group, min=eid, max=eid, count=1)
        out: dict[str, int] = {}
        for eid, rows in zip(entry_ids, pipe.execute(), strict=True):
            if rows:
                out[eid] = int(rows[0]["times_delivered"])
        return out

    def strikes(
        self,
        request_id: str,
        entry_id: str,
        deliveries: int,
        queued_tokens: int,
        alive: bool = False,
    ) -> int:
        """Deliveries of the entry since the last one that found new tokens in out:{id}.

        `queued_tokens`: the tokens the task carried when queued (its first delivery's count);
        `alive`: the claimant already holds it (a late renewal), which proves no crash.
        Recorded in req:{id} (claim_entry, claim_emitted, claim_delivery) at every claim."""
        args = [entry_id, deliveries, queued_tokens, "1" if alive else "0"]
        return int(self._strikes(keys=[self.keys.request(request_id)], args=args))

    def renew(self, stream: str, group: str, entry_ids: list[str]) -> list[str]:
        """Reset the lease of entries still owned; return the ids another consumer took."""
        if not entry_ids:
            return []
        lost = self._renew(keys=[stream], args=[group, self.consumer, *entry_ids])
        return [as_str(x) for x in lost or []]

    def release(self, stream: str, group: str, entry_ids: list[str], lease_ms: int) -> None:
        """Mark entries this consumer holds as idle for a whole lease: claimable at once.

        Fenced by the renew script's owner check, so an entry already claimed by another
        consumer is left alone (XCLAIM JUSTID does not count a delivery)."""
        if entry_ids:
            self._release(keys=[stream], args=[group, self.consumer, lease_ms, *entry_ids])

    # fenced writes
    def emit(self, emission: Emission) -> FencedResult:
        """Append one chunk to out:{id} if this consumer owns the entry and the index matches."""
        return self.emit_many([emission])[0]

    def emit_many(self, emissions: list[Emission]) -> list[FencedResult]:
        """Fenced emission of several chunks in one round trip (results in order).

        Plain EVALSHA in the pipeline: redis-py's `Script` in a pipeline sends SCRIPT EXISTS
        before every execute, a second round trip per token (issue 19, one stream). A server
        that lost its script cache (a restart) answers NOSCRIPT; the script is loaded and only
        those calls are sent again (a NOSCRIPT call ran nothing, so nothing can repeat)."""
        if not emissions:
            return []
        now = f"{time.time():.3f}"
        calls = []
        for em in emissions:
            chunk = em.chunk
            fields = {rec.UPDATED: now, **(em.req_fields or {})}
            calls.append(
                (
                    em.stream,
                    self.keys.out(em.request_id),
                    self.keys.request(em.request_id),
                    em.group,
                    self.consumer,
                    em.entry_id,
                    chunk.index,
                    len(chunk.token_ids),
                    chunk.encode(),
                    "1" if chunk.finished else "0",
                    self.out_ttl_s,
                    self.req_ttl_s,
                    *_flat(fields),
                )
            )
        if len(calls) == 1:  # the usual case at low load: no pipeline object to build
            try:
                reply = self.r.execute_command("EVALSHA", self._emit.sha, 3, *calls[0])
            except redis.exceptions.NoScriptError:
                self.r.script_load(self._emit.script)
                reply = self.r.execute_command("EVALSHA", self._emit.sha, 3, *calls[0])
            return [_fenced(reply)]
        replies: list = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            pipe = self.r.pipeline(transaction=False)
            for i in todo:
                pipe.execute_command("EVALSHA", self._emit.sha, 3, *calls[i])
            results = pipe.execute(raise_on_error=False)
            missing = []
            for i, res in zip(todo, results, strict=True):
                if isinstance(res, redis.exceptions.NoScriptError) and attempt == 0:
                    missing.append(i)
                elif isinstance(res, Exception):
                    raise res
                else:
                    replies[i] = res
            if not missing:
                break
            self.r.script_load(self._emit.script)
            todo = missing
        return [_fenced(reply) for reply in replies]

    def handoff(
        self,
        stream: str,
        group: str,
        entry_id: str,
        next_stream: str,
        request_id: str,
        payload: bytes,
        chunk: TokenChunk | None = None,
        req_fields: dict[str, str | int | float] | None = None,
    ) -> FencedResult:
        """XADD `payload` to the next stream and XACK this entry, emitting `chunk` first."""
        fields = {rec.UPDATED: f"{time.time():.3f}", **(req_fields or {})}
        reply = self._handoff(
            keys=[stream, next_stream, self.keys.request(request_id), self.keys.out(request_id)],
            args=[
                group,
                self.consumer,
                entry_id,
                payload,
                chunk.encode() if chunk else b"",
                chunk.index if chunk else 0,
                len(chunk.token_ids) if chunk else 0,
                *_flat(fields),
            ],
        )
        return _fenced(reply)

    def dead_letter(
        self,
        stream: str,
        group: str,
        entry_id: str,
        payload: bytes | None,
        reason: str,
        request_id: str = "",
    ) -> str | None:
        """Move an entry to the DLQ with its reason and ack it; finish the client's output."""
        chunk_payload, index = b"", 0
        if request_id:
            raw = self.r.hget(self.keys.request(request_id), rec.EMITTED)
            index = int(raw or 0)
            chunk = TokenChunk(index=index, finish_reason=FinishReason.ERROR, error=reason)
            chunk_payload = chunk.encode()
        req_key = self.keys.request(request_id) if request_id else self.keys.dlq
        out_key = self.keys.out(request_id) if request_id else self.keys.dlq
        reply = self._dead_letter(
            keys=[stream, self.keys.dlq, req_key, out_key],
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
    def emitted_tokens(self, request_id: str) -> tuple[list[int], int, bool]:
        """What out:{id} already holds: the token ids (in order), the length of their text in
        characters, and whether a final chunk was written."""
        tokens: list[int] = []
        text_len = 0
        finished = False
        for _eid, fields in self.r.xrange(self.keys.out(request_id)):
            chunk = TokenChunk.decode(fields[MESSAGE_FIELD])
            if chunk.index != len(tokens):
                raise ValueError(f"out:{request_id} has a gap at index {len(tokens)}")
            tokens.extend(chunk.token_ids)
            text_len += len(chunk.text)
            finished = finished or chunk.finished
        return tokens, text_len, finished

    def cancelled(self, request_ids: list[str]) -> set[str]:
        """The subset of request ids with a cancel:{id} flag set."""
        if not request_ids:
            return set()
        pipe = self.r.pipeline(transaction=False)
        for rid in request_ids:
            pipe.exists(self.keys.cancel(rid))
        return {rid for rid, n in zip(request_ids, pipe.execute(), strict=True) if n}

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
        return {as_str(name) for name in pipe.execute() if name}

    def prune_consumers(
        self, stream: str, group: str, idle_ms: int = 600_000, dead_idle_ms: int = 30_000
    ) -> int:
        """Delete consumers that own nothing and were idle `dead_idle_ms` while no live worker
        names them (a restart makes a new consumer), or `idle_ms` in any case."""
        live = self.live_consumers()
        removed = 0
        for info in self.r.xinfo_consumers(stream, group):
            name = as_str(info["name"])
            if name == self.consumer or info["pending"]:
                continue  # entries of a dead consumer are claimed after the lease; prune later
            if info["idle"] > (idle_ms if name in live else min(idle_ms, dead_idle_ms)):
                removed += int(self._prune(keys=[stream], args=[group, name]) == 0)
        return removed


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
