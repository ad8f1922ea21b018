"""Reading a request's output stream `out:{id}` (blocking XREAD), shared by ingress and client.

Chunks come in token order; `start_index` resumes after tokens the reader already has. If the
stream stays quiet while `req:{id}` says the request ended (failed, cancelled) without a final
chunk, a final chunk is made up from the record so readers never wait for the deadline.
`out:{id}` expires (workers' out_ttl, 10 min) long before `req:{id}` (24 h): a request that
ended and whose stream is gone raises OutputExpired, never a deadline timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvrelay.core import record as rec
from kvrelay.core.enums import FinishReason, RequestStatus
from kvrelay.core.errors import KvrelayError
from kvrelay.core.keys import MESSAGE_FIELD, Keys
from kvrelay.core.messages import MessageError, TokenChunk
from kvrelay.core.record import as_str
from kvrelay.pipeline.queue.outage import REDIS_RETRY_S, Outage

logger = logging.getLogger(__name__)

# a request hash that ended without its final chunk: the finish reason to report
TERMINAL = {
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


async def check_output(redis: aioredis.Redis, keys: Keys, request_id: str) -> None:
    """Raise OutputExpired when req:{id} says the request ended and out:{id} is gone."""
    status, emitted = await redis.hmget(keys.request(request_id), rec.STATUS, rec.EMITTED)
    if status is None or as_str(status) not in ENDED:
        return
    if output_gone(as_str(status), emitted, bool(await redis.exists(keys.out(request_id)))):
        raise OutputExpired(request_id, as_str(status))


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


async def read_chunks(
    redis: aioredis.Redis,
    keys: Keys,
    request_id: str,
    *,
    start_index: int = 0,
    block_ms: int = 1000,
    deadline: float | None = None,
    retext: Callable[[list[int]], str] | None = None,
    redis_retry_s: float = REDIS_RETRY_S,
) -> AsyncIterator[TokenChunk]:
    """Yield the chunks covering tokens >= start_index, ending with the final chunk.

    `deadline` is unix seconds; past it OutputTimeout is raised (OutputExpired instead when
    the request ended and its stream expired; RequestNotFound when there is no record).
    Redis unreachable (a Valkey restart) is waited out for `redis_retry_s` before the
    connection error is raised: the request lives on in the append-only file.
    """
    last_id, next_index = "0-0", 0
    outage = Outage(f"request {request_id}", redis_retry_s)
    while True:
        try:
            reply, final = await _poll(redis, keys, request_id, last_id, block_ms, deadline)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            # a read that timed out is retried too: it changes nothing, unlike a submission
            if not await outage.wait(exc):
                raise
            continue
        outage.over()
        if final is not None:
            final.index = max(final.index, next_index)
            yield final
            return
        for entry_id, fields in reply:
            last_id = entry_id
            try:
                chunk = TokenChunk.decode(fields[MESSAGE_FIELD])
            except (KeyError, MessageError) as exc:
                # A worker wrote it through the fenced script, so this is a bug worth shouting.
                logger.error("request %s: unreadable out entry %s: %s", request_id, entry_id, exc)
                continue
            end = chunk.index + len(chunk.token_ids)
            if chunk.token_ids and end <= next_index:
                continue  # tokens this reader already yielded (never expected: fenced emits)
            next_index = max(next_index, end)
            if next_index > start_index or chunk.finished:
                yield trim_chunk(chunk, start_index, retext)
            if chunk.finished:
                return


async def _poll(
    redis: aioredis.Redis,
    keys: Keys,
    request_id: str,
    last_id: Any,
    block_ms: int,
    deadline: float | None,
) -> tuple[list, TokenChunk | None]:
    """One blocking read of out:{id}: (entries, None), or ([], made-up final chunk)."""
    out_key, timeout = keys.out(request_id), block_ms
    if deadline is not None:
        left = deadline - time.time()
        if left <= 0:
            await check_output(redis, keys, request_id)
            raise OutputTimeout(f"request {request_id} passed its deadline")
        timeout = max(1, min(block_ms, int(left * 1000)))
    reply = await redis.xread({out_key: last_id}, count=256, block=timeout)
    entries = reply[0][1] if reply else []
    if entries:
        return entries, None
    return [], await _ended_without_chunk(redis, keys, request_id, out_key, last_id)


async def _ended_without_chunk(
    redis: aioredis.Redis, keys: Keys, request_id: str, out_key: str, last_id: Any
) -> TokenChunk | None:
    """A made-up final chunk when the record says the request ended and no chunk says so."""
    status, error, emitted = await redis.hmget(
        keys.request(request_id), rec.STATUS, rec.ERROR, rec.EMITTED
    )
    if status is None:
        if await redis.exists(out_key):
            return None  # record expired first; the stream may still finish
        raise RequestNotFound(request_id)
    reason = TERMINAL.get(as_str(status))
    if reason is None:
        return None
    if output_gone(as_str(status), emitted, bool(await redis.exists(out_key))):
        raise OutputExpired(request_id, as_str(status))
    # The final chunk may have landed between the empty read and the record check.
    if await redis.xread({out_key: last_id}, count=1):
        return None
    message = as_str(error) if error else f"request ended with status {as_str(status)}"
    return TokenChunk(
        index=int(emitted or 0),
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
