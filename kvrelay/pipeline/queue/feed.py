"""The output feed: one reader per process (the ingress, a producer client) of the chunks of
every request it follows (docs/internals.md, "Queue plane: progress, feeds, history").

Workers XADD each step's chunks for the requests a reader follows to its stream `feed:{reader}`
(one field `m`: a framed request id and a framed TokenChunk per request, `core.messages.frame`;
one argument to the step script however many requests); one background task blocks on it and
hands each
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
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from redis.exceptions import RedisError

from kvrelay.core.keys import MESSAGE_FIELD, Keys
from kvrelay.core.messages import MessageError, TokenChunk, unframe
from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.outage import FIRST_PAUSE_S, MAX_PAUSE_S, REDIS_RETRY_S
from kvrelay.pipeline.queue.redis_options import AsyncRedis
from kvrelay.pipeline.queue.replies import StreamReply
from kvrelay.pipeline.queue.subscription import WAKE, Subscription

logger = logging.getLogger(__name__)


READ_COUNT = 512  # feed entries per XREAD
BLOCK_MS = 1000  # XREAD BLOCK slice; a reader's deadlines are checked between slices
FEED_TTL_S = 60  # a reader that stops renewing its feed (it died) leaves nothing behind
RENEW_S = 20.0
QUIET_S = 3.0  # a request silent this long has its record checked
PLACEHOLDER = b""  # the field of the entry that creates a feed (no request id is empty)
_ATTACH_LUA = scripts.with_progress("attach")


class OutputFeed:
    """The process's one reader of its feed stream, dispatching chunks to subscriptions."""

    def __init__(
        self,
        redis: AsyncRedis,
        keys: Keys,
        *,
        block_ms: int = BLOCK_MS,
        redis_retry_s: float = REDIS_RETRY_S,
        quiet_s: float = QUIET_S,
        renew_s: float = RENEW_S,
        ttl_s: int = FEED_TTL_S,
        reader_id: str | None = None,
    ):
        self.redis, self.keys = redis, keys
        self.reader_id = reader_id or uuid.uuid4().hex[:16]
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
        self._loop: asyncio.AbstractEventLoop | None = None  # where the reader task runs
        self._attach_script = redis.register_script(_ATTACH_LUA)

    # lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the feed and start its reader task (once; also done by the first subscribe).
        Redis unreachable: the task creates the feed once it answers."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or an app reused on another event loop
            self._loop, self._start_lock, self._task, self._subs = loop, asyncio.Lock(), None, {}
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
                reply = cast(
                    "StreamReply",
                    await self.redis.xread(
                        {self.key: self._last_id}, count=READ_COUNT, block=self.block_ms
                    ),
                )
            except RedisError as exc:
                if not self._lost:
                    logger.warning("output feed %s: redis unavailable (%s)", self.reader_id, exc)
                    for subs in self._subs.values():
                        for sub in subs:
                            sub.queue.put_nowait(WAKE)
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
        packed = fields.get(MESSAGE_FIELD)
        if packed is None:
            return  # the placeholder that created the feed
        try:
            frames = unframe(packed)
        except MessageError as exc:  # a worker's script wrote it: a bug worth shouting
            logger.error("feed %s: unreadable entry: %s", self.reader_id, exc)
            return
        for request_id, payload in zip(frames[::2], frames[1::2], strict=False):
            subs = self._subs.get(request_id)
            if not subs:
                continue  # a request no one here reads any more
            try:
                chunk = TokenChunk.decode(payload)
            except MessageError as exc:  # a worker's script wrote it: a bug worth shouting
                logger.error("feed %s: unreadable chunk of %r: %s", self.reader_id, request_id, exc)
                continue
            for sub in subs:
                sub.queue.put_nowait(chunk)


class OutputFeeds:
    """A process's output readers, one `OutputFeed` per pipeline shard (a cluster cannot read
    streams of several slots in one call), all under one reader id: a request names that id and
    its shard's workers write to its shard's feed. One shard: the one feed itself."""

    def __init__(self, redis: AsyncRedis, keys: Keys, **options: Any):
        first = OutputFeed(redis, keys.at(0), **options)
        self.reader_id = first.reader_id
        self.keys = keys
        options["reader_id"] = self.reader_id
        self.feeds = [first, *(OutputFeed(redis, k, **options) for k in keys.all()[1:])]

    def of(self, request_id: str) -> OutputFeed:
        """The feed of the request's shard."""
        return self.feeds[self.keys.of(request_id).shard]

    async def start(self) -> None:
        for feed in self.feeds:
            await feed.start()

    async def stop(self) -> None:
        for feed in self.feeds:
            await feed.stop()

    async def subscribe(self, request_id: str) -> Subscription:
        return await self.of(request_id).subscribe(request_id)

    def chunks(self, request_id: str, **kwargs: Any) -> AsyncIterator[TokenChunk]:
        return self.of(request_id).chunks(request_id, **kwargs)


def output_feed(redis: AsyncRedis, keys: Keys, **options: Any) -> OutputFeed | OutputFeeds:
    """The process's output reader: one `OutputFeed` for one shard, `OutputFeeds` for more."""
    if keys.shards == 1:
        return OutputFeed(redis, keys, **options)
    return OutputFeeds(redis, keys, **options)
