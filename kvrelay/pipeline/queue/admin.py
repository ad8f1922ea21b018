"""Read and change pipeline state for the admin CLI (sync redis-py; no torch, no engine)."""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

import redis

from kvrelay.core import record as rec
from kvrelay.core.enums import DONE_STATUSES, RequestStatus, WorkerField
from kvrelay.core.keys import Keys
from kvrelay.core.messages import MessageError, TokenChunk, decode_chunks, frame
from kvrelay.core.record import RequestRecord, as_str
from kvrelay.core.worker_record import WorkerRecord
from kvrelay.pipeline.queue import choices_state, scripts
from kvrelay.pipeline.queue.progress import Progress

logger = logging.getLogger(__name__)

# the rule of kvrelay.pipeline.queue.submit.valid_request_id (not imported: it pulls in pydantic)
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# req:{id} fields that hold numbers; `ingress` holds JSON
REQUEST_INT_FIELDS = rec.INT_FIELDS
REQUEST_FLOAT_FIELDS = rec.FLOAT_FIELDS


def _hash(r: redis.Redis, key: str) -> dict[str, str]:
    return {as_str(k): as_str(v) for k, v in r.hgetall(key).items()}


def workers(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Live workers from their heartbeat hashes (`WorkerRecord.status`: numbers as numbers,
    None when empty), with the heartbeat age in seconds and the hash's TTL. A worker beats on
    every shard it serves: it is listed once, from its lowest shard's hash."""
    out = []
    seen: set[str] = set()
    now = time.time()
    for shard in keys.all():
        for key in sorted(r.scan_iter(match=shard.worker_pattern, count=1000)):
            name = as_str(key)[len(shard.worker("")) :]
            if name in seen:
                continue
            record = WorkerRecord.decode(r.hgetall(key))
            if record is None:
                continue
            seen.add(name)
            info = record.status()
            updated = now if record.updated is None else record.updated
            info["age_s"] = round(now - updated, 2)
            info["ttl_s"] = r.ttl(key)
            out.append(info)
    return out


def _number(value: str, kind: type) -> Any:
    """The field as int/float; None when empty; the string itself when it is not a number."""
    if value == "":
        return None
    try:
        return kind(value)
    except ValueError:
        return value


def stream_info(r: redis.Redis, stream: str, group: str) -> dict[str, Any]:
    """Length, pending, lag and consumers of one stream's group."""
    info: dict[str, Any] = {"stream": stream, "group": group, "length": r.xlen(stream)}
    try:
        groups = {as_str(g["name"]): g for g in r.xinfo_groups(stream)}
    except redis.ResponseError:
        groups = {}
    g = groups.get(group)
    if g is None:
        info.update(pending=0, lag=None, consumers=0)
        return info
    info.update(
        pending=int(g["pending"]),
        lag=g.get("lag"),
        consumers=int(g["consumers"]),
        last_delivered=as_str(g["last-delivered-id"]),
    )
    return info


def requests_in_flight(r: redis.Redis, keys: Keys, limit: int = 100000) -> dict[str, int]:
    """Count of requests by status (queued, prefilling, decoding, ...), every shard's.

    A request of several choices counts once, with the status combined from its choices' (as
    GET /v1/requests/{id} shows it: its own record keeps the `queued` it was written with);
    its choices' records are not counted on their own. Read in pipelined batches: finished
    records stay for a day, and `status --watch` asks every second."""
    counts: dict[str, int] = {}
    left = limit
    for shard in keys.all():
        batch: list[Any] = []
        for key in r.scan_iter(match=shard.request_pattern, count=1000):
            batch.append(key)
            if len(batch) == STATUS_BATCH:
                left = _count_statuses(r, shard, batch, counts, left)
                batch = []
            if left <= 0:
                return counts
        left = _count_statuses(r, shard, batch, counts, left)
        if left <= 0:
            break
    return counts


STATUS_BATCH = 1000
_STATUS_FIELDS = [rec.STATUS, rec.NUM_CHOICES, rec.PARENT]


def _count_statuses(
    r: redis.Redis, shard: Keys, batch: list[Any], counts: dict[str, int], left: int
) -> int:
    """Add the statuses of `batch` (req:{id} keys of `shard`) to `counts`, up to `left`
    requests; returns how many may still be counted."""
    with r.pipeline(transaction=False) as pipe:
        for key in batch:
            pipe.hmget(key, _STATUS_FIELDS)
        replies = pipe.execute()
    requests: list[tuple[str, str, int]] = []  # (id, stored status, choices)
    for key, (status, num_choices, parent) in zip(batch, replies, strict=True):
        if parent or left <= len(requests):  # a choice: counted in its parent's status
            continue
        choices = as_str(num_choices)
        request_id = as_str(key)[len(shard.request("")) :]
        requests.append((request_id, as_str(status), int(choices) if choices.isdigit() else 0))
    with r.pipeline(transaction=False) as pipe:
        for request_id, _status, count in requests:
            for k in range(count):
                pipe.hget(shard.request(choices_state.choice_id(request_id, k)), rec.STATUS)
        choice_statuses = iter(pipe.execute())
    for _id, status, count in requests:
        if count:
            records = [
                RequestRecord.decode_fields([rec.STATUS], [next(choice_statuses)])
                for _ in range(count)
            ]
            status = choices_state.combined_status(records)
        counts[status or "unknown"] = counts.get(status or "unknown", 0) + 1
    return left - len(requests)


def valid_request_id(request_id: str) -> bool:
    """True for ids a request can have (1-128 characters of [A-Za-z0-9._:-])."""
    return REQUEST_ID.fullmatch(request_id) is not None


def request_record(raw: dict[str, str]) -> dict[str, Any]:
    """A req:{id} hash with numbers as numbers ("" -> None) and `ingress` as an object."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name in REQUEST_INT_FIELDS or name in REQUEST_FLOAT_FIELDS:
            out[name] = _number(value, int if name in REQUEST_INT_FIELDS else float)
        elif name == "ingress" and value:
            try:
                out[name] = json.loads(value)
            except ValueError:
                out[name] = value
        else:
            out[name] = value
    return out


def _progress(r: redis.Redis, keys: Keys, request_id: str) -> Progress | None:
    """The request's progress while it runs (None once it ended, or when unreadable)."""
    try:
        [raw] = r.eval(choices_state.LIVE_LUA, 1, keys.progress, request_id)
        return Progress.parse(raw or None)
    except ValueError:
        logger.error("request %s: malformed progress", request_id)
        return None


def _chunks(r: redis.Redis, keys: Keys, request_id: str) -> tuple[list[TokenChunk], int]:
    """The request's chunks (out:{id}, then the tail of its progress while it runs), and how
    many entries did not decode (shown, not fatal)."""
    chunks, bad = [], 0
    read = r.register_script(scripts.with_progress("attach"))
    _raw, runs, tail = read(
        keys=[keys.progress, keys.out(request_id)], args=[request_id, "", 0, "0"]
    )  # a reader with no feed: reads only
    runs.append(b"".join(frame(payload) for payload in tail))
    for run in runs:
        try:
            chunks.extend(decode_chunks(run))
        except MessageError:
            bad += 1
    return chunks, bad


def show_request(r: redis.Redis, keys: Keys, request_id: str) -> dict[str, Any] | None:
    """The req:{id} record plus what its output stream holds; None when neither exists.

    A request of several choices shows its status, counts and times combined from its
    choices' (as GET /v1/requests/{id} does), `choices` (each one's public view), and the
    output of all of them summed (`output_text` null: each choice's is `show {id}.{k}`)."""
    keys = keys.of(request_id)  # the request's shard (its choices' too)
    raw = _hash(r, keys.request(request_id))
    record = request_record(raw)
    parent = RequestRecord.decode(raw)
    count = (parent.num_choices or 0) if parent is not None else 0
    if parent is not None and count:
        records = choices_state.read_choices_sync(r, keys, request_id, count)
        combined = choices_state.combine(parent, records).public()
        record.update({name: combined[name] for name in choices_state.COMBINED_FIELDS})
        record["choices"] = choices_state.choices_view(request_id, records)
    elif (progress := _progress(r, keys, request_id)) is not None:
        # while it runs, its progress holds the live count (the record's lags behind)
        record.update(completion_tokens=progress.emitted, emitted=progress.emitted)
    ids = [choices_state.choice_id(request_id, k) for k in range(count)] or [request_id]
    outputs = [_chunks(r, keys, one) for one in ids]
    if not record and not outputs[0][0] and not outputs[0][1]:
        return None
    chunks = [c for one, _ in outputs for c in one]
    return {
        "request_id": request_id,
        **record,
        "output_tokens": sum(len(c.token_ids) for c in chunks),
        "output_chunks": len(chunks),
        "output_bad_chunks": sum(bad for _, bad in outputs),
        "output_text": None if count else "".join(c.text for c in chunks),
        "finished": all(any(c.finished for c in one) for one, _ in outputs),
        # the flag while it runs; once it ended (its progress gone), how it ended
        "cancel_requested": choices_state.cancel_requested_sync(r, keys, request_id, count)
        or choices_state.cancel_ended(record),
        "out_ttl_s": min(r.ttl(keys.out(one)) for one in ids),
    }


def cancel_request(r: redis.Redis, keys: Keys, request_id: str) -> dict[str, Any] | None:
    """Set the cancel flag in the request's progress (and each choice's, for a request of
    several) unless the request already ended; None if unknown.

    Returns {request_id, cancelled, status, finish_reason}: `cancelled` is False when the
    request had already ended (nothing to stop; the HTTP DELETE answers the same way). The
    status of a request of several choices is combined from theirs.
    """
    keys = keys.of(request_id)  # the request's shard (its choices' too)
    raw = _hash(r, keys.request(request_id))
    out_key = keys.out(request_id)
    if not raw and not r.exists(out_key):
        return None
    parent = RequestRecord.decode(raw)
    count = (parent.num_choices or 0) if parent is not None else 0
    if parent is not None and count:
        combined = choices_state.combine(
            parent, choices_state.read_choices_sync(r, keys, request_id, count)
        )
        raw = {
            **raw,
            rec.STATUS: str(combined.status),
            rec.FINISH_REASON: combined.finish_reason or "",
        }
    status = raw.get(rec.STATUS, "")
    ended = status in DONE_STATUSES
    if not ended and not raw:  # no record (expired): the output stream tells whether it ended
        ended = any(c.finished for c in _chunks(r, keys, request_id)[0])
        status = RequestStatus.FINISHED if ended else ""
    if not ended:
        choices_state.cancel_sync(r, keys, choices_state.cancel_ids(request_id, count))
    return {
        "request_id": request_id,
        "cancelled": not ended,
        "status": status or None,
        "finish_reason": raw.get(rec.FINISH_REASON) or None,
    }


def drain(r: redis.Redis, keys: Keys, worker: str, undo: bool = False) -> bool:
    """Ask a worker to stop (or resume) taking new work, on every shard it serves (each of its
    readers reads its own shard's flag); False if no such live worker."""
    found = [shard.worker(worker) for shard in keys.all() if r.exists(shard.worker(worker))]
    flag: dict[Any, Any] = WorkerRecord(drain=not undo).encode((WorkerField.DRAIN,))
    for key in found:
        r.hset(key, mapping=flag)
    return bool(found)


def wait_draining(
    r: redis.Redis, keys: Keys, worker: str, draining: bool, timeout_s: float
) -> bool | None:
    """Wait until the worker's heartbeat publishes `draining` (on its lowest shard); False on
    timeout, None if gone."""
    key = next(
        (s.worker(worker) for s in keys.all() if r.exists(s.worker(worker))), keys.worker(worker)
    )
    deadline = time.monotonic() + timeout_s
    while True:
        value = r.hget(key, WorkerField.DRAINING)
        if (
            value is not None
            and WorkerRecord.partial(WorkerField.DRAINING, value).draining is draining
        ):
            return True
        if value is None and not r.exists(key):
            return None
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
