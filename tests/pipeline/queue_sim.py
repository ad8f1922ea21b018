"""A stand-in for the workers' side of the queue plane (tests only): write a request's
progress, history and feeds exactly as docs/internals.md, "Queue plane", says workers do."""

from __future__ import annotations

from typing import Any

import redis

from kvrelay.core import record as rec
from kvrelay.core.enums import RequestStatus
from kvrelay.core.keys import MESSAGE_FIELD, Keys
from kvrelay.core.messages import TokenChunk, frame
from kvrelay.pipeline.queue.progress import Progress, feed_item, new_progress, owner_of, tail_entry

# the stand-in worker: the owner of every request it writes, whose tail hash holds the tails
CONSUMER = "sim-worker"


def submit(r: redis.Redis, keys: Keys, request_id: str, feed: str = "", **record) -> None:
    """A queued request's record and progress (what the submit scripts write)."""
    r.hset(keys.request(request_id), mapping={rec.STATUS: RequestStatus.QUEUED, **record})
    r.hset(keys.progress, request_id, new_progress(feed))


# (key prefix, request id) -> the tail's chunks, as a worker keeps them to flush them
_TAILS: dict[tuple[str, str], list[TokenChunk]] = {}
_STEPS: dict[str, int] = {}  # key prefix -> the stand-in's last step number


def _next_step(keys: Keys) -> int:
    _STEPS[keys.prefix] = _STEPS.get(keys.prefix, 0) + 1
    return _STEPS[keys.prefix]


def _step(
    keys: Keys, rid: str, progress: Progress | None, chunk: TokenChunk, flush: bool
) -> tuple[Progress, bytes]:
    """The progress after one chunk, and the run of frames to flush to out:{id} (b"": none):
    flushed when asked and with the final chunk."""
    progress = progress or Progress(emitted=chunk.index, hist=chunk.index)
    progress.owner = progress.owner or owner_of(CONSUMER, "0-0")
    tail = _TAILS.setdefault((keys.prefix, rid), [])
    tail.append(chunk)
    progress.emitted = max(progress.emitted, chunk.index + len(chunk.token_ids))
    run = b""
    if flush or chunk.finished:
        run = b"".join(frame(c.encode()) for c in tail)
        progress.hist = progress.emitted
        _TAILS.pop((keys.prefix, rid))
    return progress, run


def _writes(
    pipe: Any,
    keys: Keys,
    rid: str,
    chunk: TokenChunk,
    p: Progress,
    run: bytes,
    publish: bool = True,
) -> None:
    if run:  # (the step fields of its tail stay: a walk starts at the progress's `hist`)
        pipe.xadd(keys.out(rid), {MESSAGE_FIELD: run})
    else:
        pipe.hset(keys.tail(CONSUMER), _next_step(keys), tail_entry([(rid, chunk.encode())]))
    if chunk.finished:  # the end: the record's count, the progress gone
        pipe.hset(keys.request(rid), rec.EMITTED, p.emitted)
        pipe.hdel(keys.progress, rid)
    else:
        pipe.hset(keys.progress, rid, p.encode())
    for feed in p.feeds if publish else ():
        pipe.spublish(keys.feed(feed), feed_item(rid, chunk.encode()))


def emit(
    r: Any,
    keys: Keys,
    request_id: str,
    chunk: TokenChunk,
    flush: bool = False,
    progress: Progress | None = None,
    end_status: bool = True,
    publish: bool = True,
) -> None:
    """One worker step of one request: the chunk appended to the tail (flushed to out:{id}
    when asked and with the final chunk), then one message on each feed following it (not
    with `publish=False`: a message no reader got); the final chunk ends the request (record
    fields, progress deleted). `r` may be a pipeline, given the request's `progress`."""
    progress = progress or Progress.parse(r.hget(keys.progress, request_id))
    progress, run = _step(keys, request_id, progress, chunk, flush)
    if chunk.finished and end_status:
        r.hset(
            keys.request(request_id),
            mapping={rec.STATUS: RequestStatus.FINISHED, rec.FINISH_REASON: chunk.finish_reason},
        )
    _writes(r, keys, request_id, chunk, progress, run, publish)


async def emit_async(r: Any, keys: Keys, request_id: str, chunk: TokenChunk) -> None:
    """emit() for asyncio redis, leaving the record's status to the caller."""
    progress = Progress.parse(await r.hget(keys.progress, request_id))
    progress, run = _step(keys, request_id, progress, chunk, False)
    async with r.pipeline(transaction=True) as pipe:
        _writes(pipe, keys, request_id, chunk, progress, run)
        await pipe.execute()


def step(r: redis.Redis, keys: Keys, chunks: dict[str, TokenChunk]) -> None:
    """One worker step of several requests: one feed message per feed for all of them."""
    by_feed: dict[str, list[bytes]] = {}
    tail: list[tuple[str, bytes]] = []
    for request_id, chunk in chunks.items():
        progress = Progress.parse(r.hget(keys.progress, request_id))
        progress, _ = _step(keys, request_id, progress, chunk, False)
        r.hset(keys.progress, request_id, progress.encode())
        tail.append((request_id, chunk.encode()))
        for feed in progress.feeds:
            by_feed.setdefault(feed, []).append(feed_item(request_id, chunk.encode()))
    r.hset(keys.tail(CONSUMER), _next_step(keys), tail_entry(tail))
    for feed, items in by_feed.items():
        r.spublish(keys.feed(feed), b"".join(items))


async def cancel_flags(r: Any, keys: Keys, ids: list[str]) -> list[bool | None]:
    """Each request's cancel flag (asyncio redis); None for one without progress."""
    values = await r.hmget(keys.progress, ids)
    return [(p.cancelled if (p := Progress.parse(v)) else None) for v in values]


async def clear_cancel(r: Any, keys: Keys, ids: list[str]) -> None:
    """Take the cancel flag off each request's progress (asyncio redis)."""
    for rid, value in zip(ids, await r.hmget(keys.progress, ids), strict=True):
        if (progress := Progress.parse(value)) is not None:
            progress.cancelled = False
            await r.hset(keys.progress, rid, progress.encode())
