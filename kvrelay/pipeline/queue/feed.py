"""The output feed: one reader per process (the ingress, a producer client) of the chunks of
every request it follows (docs/internals.md, "Queue plane: progress, feeds, history").

Workers XADD each step's chunks for the requests a reader follows to its stream `feed:{reader}`
(field = request id, value = one TokenChunk); one background task blocks on it and hands each
chunk to that request's subscriptions in this process. A request the reader submitted itself
names the feed at submission, so subscribing first is enough; any other (a resumed stream, an
old request, a gap in the feed, a reconnect) attaches (`lua/attach.lua`): it adds the feed to
the request's progress and reads the history (out:{id} and the progress's tail) in one step,
and the subscription drops what it already yielded. A request that stays quiet for `quiet_s`
has its record checked (did it end without a final chunk?); nothing is polled while chunks
flow. The only periodic command is the feed's renewal (EXPIRE), every `renew_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvrelay.core import record as rec
from kvrelay.core.keys import Keys
from kvrelay.core.messages import MessageError, TokenChunk, decode_chunks
from kvrelay.core.record import as_str
from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.field_ttl import field_ttl
from kvrelay.pipeline.queue.outage import FIRST_PAUSE_S, MAX_PAUSE_S, REDIS_RETRY_S, Outage
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

logger = logging.getLogger(__name__)

T = TypeVar("T")

READ_COUNT = 512  # feed entries per XREAD
FEED_TTL_S = 60  # a reader that stops renewing its feed (it died) leaves nothing behind
RENEW_S = 20.0
QUIET_S = 3.0  # a request silent this long has its record checked
PLACEHOLDER = b""  # the field of the entry that creates a feed (no request id is empty)
_ATTACH_LUA = scripts.with_progress("attach")
_QUIET = object()  # no chunk for quiet_s
_WAKE = object()  # the feed lost Redis: each subscription checks (and rides out) the outage
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)


class OutputFeed:
    """The process's one reader of its feed stream, dispatching chunks to subscriptions."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        block_ms: int = 1000,
        redis_retry_s: float = REDIS_RETRY_S,
        quiet_s: float = QUIET_S,
        renew_s: float = RENEW_S,
        ttl_s: int = FEED_TTL_S,
    ):
        self.redis, self.keys = redis, keys
        self.reader_id = uuid.uuid4().hex[:16]
        self.key = keys.feed(self.reader_id)
        self.block_ms, self.redis_retry_s = block_ms, redis_retry_s
        self.quiet_s, self.renew_s, self.ttl_s = quiet_s, renew_s, ttl_s
        self._subs: dict[bytes, list[Subscription]] = {}
        self._last_id: Any = "0-0"
        self._renew_at = 0.0
        self._lost = False  # Redis failed: recreate the feed and re-attach before reading on
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._start_lock = asyncio.Lock()
        self._attach_script = redis.register_script(_ATTACH_LUA)

    # lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the feed and start its reader task (once; also done by the first subscribe).
        Redis unreachable: the task creates the feed once it answers."""
        async with self._start_lock:
            if self._task is not None and not self._task.done():
                return
            try:
                await self._create()
            except RedisError as exc:
                logger.warning("output feed %s: redis unavailable (%s)", self.reader_id, exc)
                self._lost = True
            self._task = asyncio.create_task(self._run(), name=f"feed-{self.reader_id}")

    async def stop(self) -> None:
        """Stop reading and delete the feed (workers stop writing to it: NOMKSTREAM)."""
        task, self._task = self._task, None
        if task is not None:
            # the task ends after its current blocking read; cancelling it mid-read is the
            # fallback (a read cancelled under some runners, anyio's, never returns)
            self._stopping = True
            await asyncio.wait([task], timeout=self.block_ms / 1000 + 1)
            if not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=1)
            self._stopping = False
            try:
                await self.redis.delete(self.key)
            except RedisError as exc:
                logger.debug("output feed %s: not deleted: %s", self.reader_id, exc)

    async def subscribe(self, request_id: str) -> Subscription:
        """A subscription to the request's chunks, receiving from now on: subscribe before
        submitting a request that names this feed."""
        await self.start()
        sub = Subscription(self, request_id)
        self._subs.setdefault(request_id.encode(), []).append(sub)
        return sub

    async def chunks(
        self,
        request_id: str,
        *,
        start_index: int = 0,
        deadline: float | None = None,
        retext: Callable[[list[int]], str] | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """The chunks of a request this reader did not submit (it attaches first); see
        Subscription.chunks."""
        sub = await self.subscribe(request_id)
        try:
            async for chunk in sub.chunks(
                start_index=start_index, deadline=deadline, retext=retext
            ):
                yield chunk
        finally:
            sub.close()

    def _unsubscribe(self, sub: Subscription) -> None:
        key = sub.request_id.encode()
        subs = self._subs.get(key, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self._subs.pop(key, None)

    # the feed stream -----------------------------------------------------------------------
    async def _create(self) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.key, {PLACEHOLDER: b""})
            pipe.expire(self.key, self.ttl_s)
            entry_id, _ = await pipe.execute()
        self._last_id, self._renew_at = entry_id, time.monotonic() + self.renew_s

    async def _renew(self) -> None:
        """Keep the feed alive and drop what was read; a feed that vanished (Redis lost it,
        or it expired while the process stalled) is created again and every request attached
        again (the chunks it lost are in their history)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.expire(self.key, self.ttl_s)
            pipe.xtrim(self.key, minid=self._last_id)
            alive, _ = await pipe.execute()
        self._renew_at = time.monotonic() + self.renew_s
        if not alive:
            logger.warning("output feed %s vanished; recreating it", self.reader_id)
            await self._recover()

    async def _recover(self) -> None:
        """After an outage or a lost feed: the feed exists again and every subscription has
        the history it may have missed."""
        if not await self.redis.expire(self.key, self.ttl_s):
            await self._create()
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.queue.put_nowait((await sub.attach())[0])

    async def _run(self) -> None:
        pause = FIRST_PAUSE_S
        while not self._stopping:
            try:
                if self._lost:
                    await self._recover()
                    self._lost = False
                    logger.info("output feed %s: redis is back", self.reader_id)
                elif time.monotonic() >= self._renew_at:
                    await self._renew()
                reply = await self.redis.xread(
                    {self.key: self._last_id}, count=READ_COUNT, block=self.block_ms
                )
            except RedisError as exc:
                if not self._lost:
                    logger.warning("output feed %s: redis unavailable (%s)", self.reader_id, exc)
                    for subs in self._subs.values():
                        for sub in subs:
                            sub.queue.put_nowait(_WAKE)
                self._lost = True
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_PAUSE_S)
                continue
            pause = FIRST_PAUSE_S
            for entry_id, fields in reply[0][1] if reply else ():
                self._last_id = entry_id
                self._dispatch(fields)

    def _dispatch(self, fields: dict[bytes, bytes]) -> None:
        """One feed entry (one worker step): each request's chunk to its subscriptions."""
        for request_id, payload in fields.items():
            subs = self._subs.get(request_id)
            if not subs:
                continue  # a request no one here reads any more (or the placeholder)
            try:
                chunk = TokenChunk.decode(payload)
            except MessageError as exc:  # a worker's script wrote it: a bug worth shouting
                logger.error("feed %s: unreadable chunk of %r: %s", self.reader_id, request_id, exc)
                continue
            for sub in subs:
                sub.queue.put_nowait(chunk)


class Subscription:
    """One reader of one request in this process: the chunks the feed hands it, queued."""

    def __init__(self, feed: OutputFeed, request_id: str):
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
        raw, runs = await feed._attach_script(
            keys=[feed.keys.progress, feed.keys.out(rid)],
            args=[rid, feed.reader_id, MAX_FEEDS, await field_ttl(feed.redis)],
        )
        progress = Progress.parse(raw)
        self.following = progress is not None
        chunks: list[TokenChunk] = []
        for run in [*runs, progress.tail if progress else b""]:
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
        """
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
                    item = await self._next(deadline, outage)
                    if item is _QUIET or item is _WAKE:
                        pending.extend(await self._ride(outage, lambda: self._check(cursor)))
                        continue
                    if isinstance(item, list):  # history the feed read after an outage
                        pending.extend(item)
                        continue
                    chunk = item
                    if chunk.index > cursor.next_index:  # the feed lost chunks: refill
                        logger.info("request %s: feed gap at %d", self.request_id, chunk.index)
                        pending.extend((await self._ride(outage, self.attach))[0])
                        pending.append(chunk)
                        continue
                out = cursor.accept(chunk)
                if out is not None:
                    yield out
                if chunk.finished:
                    return
        finally:
            self.close()

    async def _next(self, deadline: float | None, outage: Outage) -> Any:
        """The next queued item; _QUIET after quiet_s without one; OutputTimeout (or
        OutputExpired) at the deadline."""
        wait = self.feed.quiet_s
        if deadline is not None:
            left = deadline - time.time()
            if left <= 0:
                feed = self.feed
                await self._ride(
                    outage, lambda: check_output(feed.redis, feed.keys, self.request_id)
                )
                raise OutputTimeout(f"request {self.request_id} passed its deadline")
            wait = min(wait, left)
        try:
            return await asyncio.wait_for(self.queue.get(), wait)
        except TimeoutError:
            if deadline is not None and deadline - time.time() <= 0:
                return await self._next(deadline, outage)
            return _QUIET

    async def _check(self, cursor: _Cursor) -> list[TokenChunk]:
        """A quiet request: what its record says. Chunks to yield: its history with the final
        chunk when it ended (one made up from the record when it ended without one)."""
        feed, rid = self.feed, self.request_id
        status, error, emitted = await feed.redis.hmget(
            feed.keys.request(rid), rec.STATUS, rec.ERROR, rec.EMITTED
        )
        if status is None:
            if await feed.redis.exists(feed.keys.out(rid)) or await feed.redis.hexists(
                feed.keys.progress, rid
            ):
                return []  # record expired first; the output may still finish
            raise RequestNotFound(rid)
        status = as_str(status)
        if status not in TERMINAL:
            return [] if self.following else (await self.attach())[0]
        history, runs = await self.attach()
        if any(c.finished for c in history):
            return history
        if output_gone(status, emitted, runs > 0 or bool(history)):
            raise OutputExpired(rid, status)
        ends = [cursor.next_index, int(emitted or 0)]
        ends += [c.index + len(c.token_ids) for c in history]
        return [*history, ended_chunk(status, as_str(error) if error else None, max(ends))]

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
        self.next_index = max(self.next_index, end)
        if self.next_index > self.start or chunk.finished:
            return trim_chunk(chunk, self.start, self.retext)
        return None
