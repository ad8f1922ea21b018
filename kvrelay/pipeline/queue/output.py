"""What reading a request's output means, shared by ingress and client (the reading itself is
`feed.py`'s): its errors, the made-up final chunk, cutting a chunk at a start index, and the
`Completion` gathered from the chunks.

If a request stays quiet while `req:{id}` says it ended (failed, cancelled) without a final
chunk, a final chunk is made up from the record so readers never wait for the deadline.
`out:{id}` expires (workers' out_ttl, 10 min) long before `req:{id}` (24 h): a request that
ended and whose history is gone raises OutputExpired, never a deadline timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core import record as rec
from kvrelay.core.enums import FinishReason, RequestStatus
from kvrelay.core.errors import KvrelayError
from kvrelay.core.keys import Keys
from kvrelay.core.messages import TokenChunk
from kvrelay.core.record import RequestRecord
from kvrelay.pipeline.queue.redis_options import AsyncRedis

logger = logging.getLogger(__name__)

# a request hash that ended without its final chunk: the finish reason to report
TERMINAL: dict[str, FinishReason] = {
    RequestStatus.FAILED: FinishReason.ERROR,
    RequestStatus.CANCELLED: FinishReason.CANCELLED,
    RequestStatus.FINISHED: FinishReason.ERROR,
}
ENDED = tuple(TERMINAL)
DEADLINE_PASSED = "the request passed its deadline"  # the same words from workers and ingress


class OutputTimeout(KvrelayError, TimeoutError):
    """The request's deadline passed before its final chunk arrived."""


class RequestNotFound(KvrelayError, LookupError):
    """No `req:{id}` record: the id is unknown or its record expired."""


class OutputExpired(KvrelayError, LookupError):
    """The request ended and its output stream `out:{id}` has expired (its record remains)."""

    def __init__(self, request_id: str, status: str):
        super().__init__(f"request {request_id} {status} and its output has expired")
        self.request_id, self.status = request_id, status


def output_gone(status: str, emitted: Any, out_exists: bool) -> bool:
    """Whether an ended request's output existed and has expired."""
    if out_exists or status not in ENDED:
        return False
    # finished and cancelled requests always wrote a final chunk; a failed one (dead-lettered
    # before any token) may never have had a stream: its record alone tells the outcome
    return status != RequestStatus.FAILED or int(emitted or 0) > 0


async def check_output(redis: AsyncRedis, keys: Keys, request_id: str) -> None:
    """Raise OutputExpired when req:{id} says the request ended and out:{id} is gone."""
    names, keys = (rec.STATUS, rec.EMITTED), keys.of(request_id)
    got = RequestRecord.decode_fields(names, await redis.hmget(keys.request(request_id), *names))
    if got.status is None or got.status not in ENDED:
        return
    status = str(got.status)
    if output_gone(status, got.emitted, bool(await redis.exists(keys.out(request_id)))):
        raise OutputExpired(request_id, status)


def trim_chunk(
    chunk: TokenChunk, start: int, retext: Callable[[list[int]], str] | None
) -> TokenChunk:
    """The part of a chunk at or after token `start` (the text is redone by `retext` if given)."""
    skip = max(0, start - chunk.index)
    if skip == 0:
        return chunk
    ids = chunk.token_ids[skip:]
    # with nothing left the index stays put, marking a final chunk the reader already has
    return TokenChunk(
        index=chunk.index + skip if ids else chunk.index,
        token_ids=ids,
        text=retext(ids) if retext and ids else "",
        finish_reason=chunk.finish_reason,
        usage=chunk.usage,
        logprobs=chunk.logprobs[skip:] if chunk.logprobs else chunk.logprobs,
        error=chunk.error,
        stop_reason=chunk.stop_reason,
    )


def ended_chunk(status: str, error: str | None, index: int) -> TokenChunk:
    """The final chunk made up for a request whose record says it ended (`status`, one of
    ENDED) without a final chunk: readers never wait for the deadline."""
    reason = TERMINAL[status]
    message = error or f"request ended with status {status}"
    return TokenChunk(
        index=index,
        finish_reason=reason,
        error=message if reason == FinishReason.ERROR else None,
    )


@dataclass(slots=True)
class Completion:
    """Everything a request produced, gathered from its chunks."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict[str, int] | None = None
    logprobs: list[dict[str, Any]] | None = None
    prompt_logprobs: list[dict[str, Any]] | None = None  # from chunk 0
    error: str | None = None

    def add(self, chunk: TokenChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.logprobs:
            self.logprobs = (self.logprobs or []) + list(chunk.logprobs)
        if chunk.finished:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason
            self.usage, self.error = chunk.usage, chunk.error
