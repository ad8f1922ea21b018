"""One reader of one request's output in a process (an `OutputFeed` subscription): the chunks
the feed hands it, the history it attaches for, and what it yields (each token once, from a
start index, ending with the final chunk, a made-up one when the record says it ended
without one). docs/internals.md, "Queue plane: progress, feeds, history"."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvrelay.core import record as rec
from kvrelay.core.keys import Keys
from kvrelay.core.messages import MessageError, TokenChunk, decode_chunks, frame
from kvrelay.core.record import RequestRecord
from kvrelay.pipeline.queue.field_ttl import field_ttl
from kvrelay.pipeline.queue.outage import Outage
from kvrelay.pipeline.queue.output import (
    TERMINAL,
    OutputExpired,
    OutputTimeout,
    RequestNotFound,
    check_output,
    ended_chunk,
    output_gone,
    trim_chunk,
)
from kvrelay.pipeline.queue.progress import MAX_FEEDS, Progress
from kvrelay.pipeline.queue.redis_options import AsyncRedis

logger = logging.getLogger(__name__)


class Feed(Protocol):
    """What a subscription uses of its `OutputFeed` (feed.py, which imports this module)."""

    @property
    def redis(self) -> AsyncRedis: ...
    @property
    def keys(self) -> Keys: ...
    @property
    def reader_id(self) -> str: ...
    @property
    def redis_retry_s(self) -> float: ...
    @property
    def quiet_s(self) -> float: ...
    @property
    def _attach_script(self) -> AsyncScript: ...

    def _unsubscribe(self, sub: Subscription) -> None: ...


T = TypeVar("T")

QUIET = object()  # no chunk for the feed's quiet_s
WAKE = object()  # the feed lost Redis: each subscription checks (and rides out) the outage
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)


class Subscription:
    """One reader of one request in this process: the chunks the feed hands it, queued."""

    def __init__(self, feed: Feed, request_id: str):
        self.feed, self.request_id = feed, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.following = False  # whether the request's progress names the feed, last we saw

    def close(self) -> None:
        """Stop receiving (idempotent)."""
        self.feed._unsubscribe(self)

    async def attach(self) -> tuple[list[TokenChunk], int]:
        """Follow the request through the feed and read its history: (the chunks emitted so
        far, how many out:{id} entries held them)."""
        feed, rid = self.feed, self.request_id
        raw, runs, tail = await feed._attach_script(
            keys=[feed.keys.progress, feed.keys.out(rid)],
            args=[rid, feed.reader_id, MAX_FEEDS, await field_ttl(feed.redis)],
        )
        self.following = Progress.parse(raw) is not None
        chunks: list[TokenChunk] = []
        for run in [*runs, b"".join(frame(payload) for payload in tail)]:
            try:
                chunks.extend(decode_chunks(run))
            except MessageError as exc:
                logger.error("request %s: unreadable history: %s", rid, exc)
        return chunks, len(runs)

    async def chunks(
        self,
        *,
        start_index: int = 0,
        deadline: float | None = None,
        retext: Callable[[list[int]], str] | None = None,
        submitted: bool = False,
    ) -> AsyncIterator[TokenChunk]:
        """Yield the chunks covering tokens >= start_index, ending with the final chunk.

        `submitted`: the request named this feed when it was queued, after this subscription
        was made (no history to read). `deadline` is unix seconds; past it OutputTimeout is
        raised (OutputExpired instead when the request ended and its output expired);
        RequestNotFound when there is no record. Redis unreachable (a Valkey restart) is
        waited out for the feed's `redis_retry_s` before the connection error is raised.
        A chunk that began before `start_index` is cut there (its text redone by `retext`).
        The wait is timed on the monotonic clock from the deadline's distance now: a step of
        the wall clock (a VM's clock corrected) neither ends the reply early nor stretches it.
        """
        until = None if deadline is None else time.monotonic() + (deadline - time.time())
        cursor = _Cursor(start_index, retext)
        outage = Outage(f"request {self.request_id}", self.feed.redis_retry_s)
        pending: deque[TokenChunk] = deque()
        try:
            if not submitted:
                history, runs = await self._ride(outage, self.attach)
                pending.extend(history)
                if not self.following and not runs:  # nothing to follow: ended, or unknown
                    pending.extend(await self._ride(outage, lambda: self._check(cursor)))
            while True:
                if pending:
                    chunk = pending.popleft()  # history: complete, in order
                else:
                    item = await self._next(until, outage)
                    if item is QUIET or item is WAKE:
                        pending.extend(await self._ride(outage, lambda: self._check(cursor)))
                        continue
                    if isinstance(item, list):  # history the feed read after an outage
                        pending.extend(item)
                        continue
                    chunk = item
                    if chunk.index > cursor.next_index:  # the feed lost chunks: refill
                        logger.info("request %s: feed gap at %d", self.request_id, chunk.index)
                        history = (await self._ride(outage, self.attach))[0]
                        pending.extend(history)
                        if _reach(history, cursor.next_index) >= chunk.index:
                            pending.append(chunk)
                        else:
                            # the history stops short of it: a failover lost steps its worker
                            # has not written again yet (`Emitter.repair`; its next write
                            # carries them). Taking the chunk now would skip the tokens
                            # between: it comes again with that history.
                            logger.warning(
                                "request %s: history ends at %d, before the chunk at %d: "
                                "waiting for the rest",
                                self.request_id,
                                _reach(history, cursor.next_index),
                                chunk.index,
                            )
                        continue
                out = cursor.accept(chunk)
                if out is not None:
                    yield out
                if chunk.finished:
                    return
        finally:
            self.close()

    async def _next(self, until: float | None, outage: Outage) -> Any:
        """The next queued item; QUIET after quiet_s without one; OutputTimeout (or
        OutputExpired) at `until` (the deadline on the monotonic clock)."""
        wait = self.feed.quiet_s
        if until is not None:
            left = until - time.monotonic()
            if left <= 0:
                feed = self.feed
                await self._ride(
                    outage, lambda: check_output(feed.redis, feed.keys, self.request_id)
                )
                raise OutputTimeout(f"request {self.request_id} passed its deadline")
            wait = min(wait, left)
        if not self.queue.empty():  # chunks already here: no timer task per chunk
            return self.queue.get_nowait()
        try:
            return await asyncio.wait_for(self.queue.get(), wait)
        except TimeoutError:
            if until is not None and until - time.monotonic() <= 0:
                return await self._next(until, outage)
            return QUIET

    async def _check(self, cursor: _Cursor) -> list[TokenChunk]:
        """A quiet request: what its record says. Chunks to yield: its history with the final
        chunk when it ended (one made up from the record when it ended without one)."""
        feed, rid = self.feed, self.request_id
        names = (rec.STATUS, rec.ERROR, rec.EMITTED)
        raw = await feed.redis.hmget(feed.keys.request(rid), *names)
        if raw[0] is None:  # no status: no record
            if await feed.redis.exists(feed.keys.out(rid)) or await feed.redis.hexists(
                feed.keys.progress, rid
            ):
                return []  # record expired first; the output may still finish
            raise RequestNotFound(rid)
        record = RequestRecord.decode_fields(names, raw)
        status = str(record.status or "")
        if status not in TERMINAL:
            return [] if self.following else (await self.attach())[0]
        history, runs = await self.attach()
        if any(c.finished for c in history):
            return history
        if output_gone(status, record.emitted, runs > 0 or bool(history)):
            raise OutputExpired(rid, status)
        ends = [cursor.next_index, record.emitted or 0]
        ends += [c.index + len(c.token_ids) for c in history]
        return [*history, ended_chunk(status, record.error, max(ends))]

    async def _ride(self, outage: Outage, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()` retried while Redis is unreachable, up to the outage's limit."""
        while True:
            try:
                result = await attempt()
            except _REDIS_DOWN as exc:
                if not await outage.wait(exc):
                    raise
                continue
            outage.over()
            return result


def _reach(history: list[TokenChunk], start: int) -> int:
    """Where `history` (complete and in order, from token 0) ends: the tokens it covers from
    `start` on without a hole."""
    end = start
    for chunk in history:
        if chunk.index > end:
            break
        end = max(end, chunk.index + len(chunk.token_ids))
    return end


class _Cursor:
    """How far a reading got: each chunk is yielded once, from token `start` on."""

    __slots__ = ("next_index", "retext", "start")

    def __init__(self, start: int, retext: Callable[[list[int]], str] | None):
        self.start, self.retext, self.next_index = start, retext, 0

    def accept(self, chunk: TokenChunk) -> TokenChunk | None:
        """The part of `chunk` to yield; None for tokens already yielded or before start."""
        end = chunk.index + len(chunk.token_ids)
        if chunk.token_ids and end <= self.next_index:
            return None  # history and feed both brought it
        cut = self.start
        if chunk.token_ids and self.start < self.next_index and chunk.index < self.next_index:
            # it begins inside what was yielded: chunks split differently from the ones
            # already read (never expected; its text is redone by `retext`, else left out);
            # each token still goes out once, at its own index
            logger.warning(
                "chunk at %d overlaps tokens already read (to %d): cut there",
                chunk.index,
                self.next_index,
            )
            cut = self.next_index
        self.next_index = max(self.next_index, end)
        if self.next_index > self.start or chunk.finished:
            return trim_chunk(chunk, cut, self.retext)
        return None
