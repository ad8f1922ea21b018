"""Read and change pipeline state for the admin CLI (sync redis-py; no torch, no engine)."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from kvrelay.pipeline.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.pipeline.messages import DecodeTask, MessageError, PrefillTask, TokenChunk

logger = logging.getLogger(__name__)

OPEN_STATUSES = {"queued", "prefilling", "decoding"}
# worker:{name} fields that hold numbers (Redis keeps strings); "" (e.g. metrics off) -> None
INT_FIELDS = {"pid", "load", "running", "waiting", "draining", "drain", "max_num_seqs",
              "metrics_port"}  # fmt: skip
FLOAT_FIELDS = {"updated", "tokens_per_s"}


class NotReplayable(ValueError):
    """A DLQ entry that cannot go back on a stream (no payload, unknown stream)."""


def _s(v: Any) -> Any:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def _hash(r: redis.Redis, key: str) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in r.hgetall(key).items()}


def workers(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Live workers from their heartbeat hashes, with the heartbeat age in seconds."""
    out = []
    now = time.time()
    for key in sorted(r.scan_iter(match=keys.worker_pattern, count=1000)):
        info: dict[str, Any] = _hash(r, key)
        if not info:
            continue
        for name, value in info.items():
            if name in INT_FIELDS or name in FLOAT_FIELDS:
                info[name] = _number(value, int if name in INT_FIELDS else float)
        info["age_s"] = round(now - float(info.get("updated", now)), 2)
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
        groups = {_s(g["name"]): g for g in r.xinfo_groups(stream)}
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
        last_delivered=_s(g["last-delivered-id"]),
    )
    return info


def requests_in_flight(r: redis.Redis, keys: Keys, limit: int = 100000) -> dict[str, int]:
    """Count of request records by status (queued, prefilling, decoding, ...)."""
    counts: dict[str, int] = {}
    for n, key in enumerate(r.scan_iter(match=keys.request_pattern, count=1000)):
        if n >= limit:
            break
        status = _s(r.hget(key, "status")) or "unknown"
        counts[status] = counts.get(status, 0) + 1
    return counts


def store_stats(store_run_dir: str | None) -> dict[str, Any] | None:
    """The local store node's stats (tier usage, hits), or an error note."""
    if not store_run_dir:
        return None
    try:
        from kvrelay.kvstore.client import StoreClient

        client = StoreClient(store_run_dir, timeout_s=2.0)
        try:
            return client.stats()
        finally:
            client.close()
    except Exception as exc:  # the store being down must not break `status`
        return {"error": str(exc)}


def status(r: redis.Redis, keys: Keys, store_run_dir: str | None = None) -> dict[str, Any]:
    """Everything `kvrelay status` shows, as one JSON-able dict."""
    inflight = requests_in_flight(r, keys)
    return {
        "workers": workers(r, keys),
        "streams": [
            stream_info(r, keys.prefill_stream, PREFILL_GROUP),
            stream_info(r, keys.decode_stream, DECODE_GROUP),
        ],
        "dlq": r.xlen(keys.dlq),
        "requests": inflight,
        "requests_in_flight": sum(v for k, v in inflight.items() if k in OPEN_STATUSES),
        "store": store_stats(store_run_dir),
    }


def show_request(r: redis.Redis, keys: Keys, request_id: str) -> dict[str, Any] | None:
    """The req:{id} record plus what its output stream holds."""
    record = _hash(r, keys.request(request_id))
    out_key = keys.out(request_id)
    chunks = [TokenChunk.decode(f[MESSAGE_FIELD]) for _, f in r.xrange(out_key)]
    if not record and not chunks:
        return None
    tokens = [t for c in chunks for t in c.token_ids]
    return {
        "request_id": request_id,
        **record,
        "output_tokens": len(tokens),
        "output_chunks": len(chunks),
        "output_text": "".join(c.text for c in chunks),
        "finished": any(c.finished for c in chunks),
        "cancel_requested": bool(r.exists(keys.cancel(request_id))),
        "out_ttl_s": r.ttl(out_key),
    }


def cancel_request(r: redis.Redis, keys: Keys, request_id: str, ttl_s: int = 3600) -> bool:
    """Set cancel:{id}; workers finish the request with 'cancelled'. False if unknown."""
    if not r.exists(keys.request(request_id)) and not r.exists(keys.out(request_id)):
        return False
    r.set(keys.cancel(request_id), 1, ex=ttl_s)
    return True


def dlq_entries(r: redis.Redis, keys: Keys, limit: int = 100) -> list[dict[str, Any]]:
    """Newest-last DLQ entries without their payloads."""
    out = []
    for eid, fields in r.xrange(keys.dlq, count=limit):
        row = {k: _s(v) for k, v in fields.items() if k != MESSAGE_FIELD}
        out.append({"dlq_id": _s(eid), **{_s(k): v for k, v in row.items()}})
    return out


def dlq_entry(r: redis.Redis, keys: Keys, dlq_id: str) -> dict[str, Any] | None:
    """One DLQ entry with its payload decoded when it is a valid task."""
    rows = r.xrange(keys.dlq, min=dlq_id, max=dlq_id)
    if not rows:
        return None
    fields = rows[0][1]
    payload = fields.get(MESSAGE_FIELD, b"")
    entry: dict[str, Any] = {"dlq_id": dlq_id}
    entry.update({_s(k): _s(v) for k, v in fields.items() if k != MESSAGE_FIELD})
    for cls in (PrefillTask, DecodeTask):
        try:
            entry["task"] = cls.decode(payload).to_dict()
            break
        except MessageError:
            continue
    else:
        entry["payload_hex"] = payload[:512].hex()
    return entry


def dlq_replay(r: redis.Redis, keys: Keys, dlq_id: str) -> str | None:
    """Put a dead-lettered entry back on its stream as a fresh request; returns the new id."""
    rows = r.xrange(keys.dlq, min=dlq_id, max=dlq_id)
    if not rows:
        return None
    fields = rows[0][1]
    stream = _s(fields.get(b"stream", b"")) or keys.prefill_stream
    if stream not in (keys.prefill_stream, keys.decode_stream):
        raise NotReplayable(f"DLQ entry {dlq_id} names an unknown stream {stream!r}")
    if not fields.get(MESSAGE_FIELD):  # the entry arrived without `m`: nothing to run again
        raise NotReplayable(f"DLQ entry {dlq_id} has no payload to replay (purge it instead)")
    request_id = _s(fields.get(b"request_id", b""))
    pipe = r.pipeline(transaction=True)
    if request_id:  # the error chunk ended the old output; a replay starts a fresh one
        pipe.delete(keys.out(request_id), keys.cancel(request_id))
        pipe.hset(
            keys.request(request_id),
            mapping={"status": "queued", "emitted": 0, "error": "", "finish_reason": ""},
        )
    pipe.xadd(stream, {MESSAGE_FIELD: fields[MESSAGE_FIELD]})
    pipe.xdel(keys.dlq, dlq_id)
    return _s(pipe.execute()[-2])


def dlq_purge(r: redis.Redis, keys: Keys) -> int:
    """Delete every DLQ entry; returns how many there were."""
    n = r.xlen(keys.dlq)
    r.delete(keys.dlq)
    return n


def drain(r: redis.Redis, keys: Keys, worker: str, undo: bool = False) -> bool:
    """Ask a worker to stop (or resume) taking new work; False if no such live worker."""
    key = keys.worker(worker)
    if not r.exists(key):
        return False
    r.hset(key, "drain", 0 if undo else 1)
    return True


def wait_draining(
    r: redis.Redis, keys: Keys, worker: str, draining: bool, timeout_s: float
) -> bool | None:
    """Wait until the worker's heartbeat publishes `draining`; False on timeout, None if gone."""
    key, want = keys.worker(worker), b"1" if draining else b"0"
    deadline = time.monotonic() + timeout_s
    while True:
        value = r.hget(key, "draining")
        if value == want:
            return True
        if value is None and not r.exists(key):
            return None
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
