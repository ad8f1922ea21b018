"""A stand-in for the workers' side of the queue plane (tests only): write a request's
progress, history and feeds exactly as docs/internals.md, "Queue plane", says workers do."""

from __future__ import annotations

from typing import Any

import redis

from kvrelay.core import record as rec
from kvrelay.core.enums import RequestStatus
from kvrelay.core.keys import MESSAGE_FIELD, Keys
from kvrelay.core.messages import TokenChunk, frame
from kvrelay.pipeline.queue.progress import Progress, new_progress


def submit(r: redis.Redis, keys: Keys, request_id: str, feed: str = "", **record) -> None:
    """A queued request's record and progress (what the submit scripts write)."""
    r.hset(keys.request(request_id), mapping={rec.STATUS: RequestStatus.QUEUED, **record})
    r.hset(keys.progress, request_id, new_progress(feed))


def emit(
    r: Any,
    keys: Keys,
    request_id: str,
    chunk: TokenChunk,
    flush: bool = False,
    progress: Progress | None = None,
) -> None:
    """One worker step of one request: the chunk appended to the tail (flushed to out:{id}
    when asked and with the final chunk), then one entry in each feed following it; the final
    chunk ends the request (record fields, progress deleted). `r` may be a pipeline, given
    the request's `progress`."""
    progress = progress or Progress.parse(r.hget(keys.progress, request_id))
    assert progress is not None and chunk.index == progress.emitted
    progress.tail += frame(chunk.encode())
    progress.emitted = chunk.index + len(chunk.token_ids)
    if flush or chunk.finished:
        r.xadd(keys.out(request_id), {MESSAGE_FIELD: progress.tail})
        progress.hist, progress.tail = progress.emitted, b""
    if chunk.finished:
        r.hset(
            keys.request(request_id),
            mapping={
                rec.STATUS: RequestStatus.FINISHED,
                rec.FINISH_REASON: chunk.finish_reason,
                rec.EMITTED: progress.emitted,
            },
        )
        r.hdel(keys.progress, request_id)
    else:
        r.hset(keys.progress, request_id, progress.encode())
    for feed in progress.feeds:
        r.xadd(keys.feed(feed), {request_id: chunk.encode()}, nomkstream=True)


def step(r: redis.Redis, keys: Keys, chunks: dict[str, TokenChunk]) -> None:
    """One worker step of several requests: one feed entry per feed for all of them."""
    by_feed: dict[str, dict[str, bytes]] = {}
    for request_id, chunk in chunks.items():
        progress = Progress.parse(r.hget(keys.progress, request_id))
        assert progress is not None and chunk.index == progress.emitted
        progress.tail += frame(chunk.encode())
        progress.emitted = chunk.index + len(chunk.token_ids)
        r.hset(keys.progress, request_id, progress.encode())
        for feed in progress.feeds:
            by_feed.setdefault(feed, {})[request_id] = chunk.encode()
    for feed, fields in by_feed.items():
        r.xadd(keys.feed(feed), fields, nomkstream=True)
