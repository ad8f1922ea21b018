"""Reading and poking the queue plane's state in tests the way its readers and writers do."""

from __future__ import annotations

import redis

from kvrelay.core.keys import Keys
from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.queue.progress import Progress
from kvrelay.pipeline.queue.streams import Streams


def emitted_chunks(r: redis.Redis, keys: Keys, request_id: str) -> list[TokenChunk]:
    """Every chunk emitted so far: out:{id}'s entries, then the tail."""
    return Streams(r, keys, "reader").history(request_id)[0]


def progress(r: redis.Redis, keys: Keys, request_id: str) -> Progress | None:
    return Progress.parse(r.hget(keys.progress, request_id))


def set_cancelled(r: redis.Redis, keys: Keys, request_id: str) -> None:
    """Set a request's cancel flag (as the ingress's cancel does), atomically with the
    workers' writes; a request without progress gets a new one, cancelled."""

    def flag(pipe: redis.client.Pipeline) -> None:
        prog = Progress.parse(pipe.hget(keys.progress, request_id)) or Progress()
        prog.cancelled = True
        pipe.multi()
        pipe.hset(keys.progress, request_id, prog.encode())

    r.transaction(flag, keys.progress)
