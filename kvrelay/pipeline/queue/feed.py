"""The output feed: one reader per process (the ingress, a producer client) of the chunks of
every request it follows (docs/internals.md, "Queue plane: progress, feeds, history").

Workers publish each step's chunks for the requests a reader follows on its shard channel
`feed:{reader}` (SPUBLISH from the step script: no stream, nothing in the append-only file;
one message of framed request ids and framed TokenChunks, `core.messages.frame`, however many
requests); one background task holds the subscription and hands each chunk to that request's
subscriptions in this process. A request the reader submitted itself names the feed at
submission, so subscribing first is enough; any other (a resumed stream, an old request, a
gap, a reconnect) attaches (`lua/attach.lua`): it adds the feed to the request's progress and
reads the history (out:{id} and the progress's tail) in one step, and the subscription drops
what it already yielded. Pub/sub keeps nothing for a reader that is not connected: whenever
the subscription is made again (a reconnect, redis-py's own or ours after an outage) every
subscription attaches again, and a chunk lost otherwise shows as a gap at the next one (or,
at the end, in the quiet check). A request that stays quiet for `quiet_s` has its record
checked (did it end without a final chunk?). Nothing is polled: an idle reader sends no
command.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis.asyncio.cluster as aiocluster
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from kvrelay.core.keys import Keys
from kvrelay.core.messages import MessageError, TokenChunk, unframe
from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.outage import FIRST_PAUSE_S, MAX_PAUSE_S, REDIS_RETRY_S
from kvrelay.pipeline.queue.redis_options import AsyncRedis, cluster_failures_unavailable
from kvrelay.pipeline.queue.subscription import WAKE, Subscription

logger = logging.getLogger(__name__)


BLOCK_MS = 1000  # longest wait for a message; the reader checks for stop between waits
QUIET_S = 3.0  # a request silent this long has its record checked
# message types (redis-py gives them as str)
SUBSCRIBED = "ssubscribe"  # the confirmation of a (re)subscription
UNSUBSCRIBED = "sunsubscribe"  # the server dropped it (a slot moved)
MESSAGE = "smessage"
CONFIRM_S = 10.0  # longest wait for a subscription's confirmation
_ATTACH_LUA = scripts.with_progress("attach")


class OutputFeed:
    """The process's one reader of its feed channel, dispatching chunks to subscriptions."""

    def __init__(
        self,
        redis: AsyncRedis,
        keys: Keys,
        *,
        block_ms: int = BLOCK_MS,
        redis_retry_s: float = REDIS_RETRY_S,
        quiet_s: float = QUIET_S,
        reader_id: str | None = None,
    ):
        self.redis, self.keys = redis, keys
        self.reader_id = reader_id or uuid.uuid4().hex[:16]
        self.channel = keys.feed(self.reader_id)
        self.block_ms, self.redis_retry_s, self.quiet_s = block_ms, redis_retry_s, quiet_s
        self._subs: dict[bytes, list[Subscription]] = {}
        self._pubsub: PubSub | aiocluster.ClusterPubSub | None = None
        self._lost = False  # Redis failed: subscribe again and re-attach before reading on
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._start_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # where the reader task runs
        self._attach_script = redis.register_script(_ATTACH_LUA)

    # lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Subscribe to the feed and start its reader task (once; also done by the first
        subscribe). Redis unreachable: the task subscribes once it answers."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or an app reused on another event loop
            self._loop, self._start_lock, self._task, self._subs = loop, asyncio.Lock(), None, {}
            self._pubsub = None  # (its connection belonged to the other loop)
        async with self._start_lock:
            if self._task is not None and not self._task.done():
                return
            try:
                await self._subscribe()
            except RedisError as exc:
                logger.warning("output feed %s: redis unavailable (%s)", self.reader_id, exc)
                self._lost = True
            self._task = asyncio.create_task(self._run(), name=f"feed-{self.reader_id}")

    async def stop(self) -> None:
        """Stop reading and drop the subscription (what workers still publish to the channel
        reaches no one and costs nothing)."""
        task, self._task = self._task, None
        if task is not None:
            # the task ends after its current wait; cancelling it mid-read is the fallback
            # (a read cancelled under some runners, anyio's, never returns)
            self._stopping = True
            await asyncio.wait([task], timeout=self.block_ms / 1000 + 1)
            if not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=1)
            self._stopping = False
        await self._unsubscribe_all()

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

    # the feed channel ----------------------------------------------------------------------
    async def _subscribe(self) -> None:
        """A new subscription to the channel, confirmed: a message published after this
        returns reaches the reader."""
        await self._unsubscribe_all()
        with cluster_failures_unavailable():
            if isinstance(self.redis, aiocluster.RedisCluster):
                await self.redis.initialize()  # the slot map, to find the channel's node
            pubsub = self.redis.pubsub()
            self._pubsub = pubsub
            await pubsub.ssubscribe(self.channel)
        while True:
            message = await self._next(pubsub, CONFIRM_S)
            if message is None:
                raise RedisError(f"no confirmation of the subscription to {self.channel}")
            if message["type"] == SUBSCRIBED:
                return
            if message["type"] == MESSAGE:  # (cannot come before the confirmation)
                self._dispatch(message["data"])

    async def _unsubscribe_all(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except (RedisError, OSError) as exc:
                logger.debug("output feed %s: unsubscribe: %s", self.reader_id, exc)

    @staticmethod
    async def _next(pubsub: PubSub | aiocluster.ClusterPubSub, timeout_s: float) -> Any:
        """The next message (a subscription's confirmation too), or None after `timeout_s`."""
        with cluster_failures_unavailable():
            if isinstance(pubsub, aiocluster.ClusterPubSub):
                return await pubsub.get_sharded_message(timeout=timeout_s)
            return await pubsub.get_message(timeout=timeout_s)

    async def _recover(self) -> None:
        """After an outage: subscribed again, and every subscription has the history it may
        have missed."""
        await self._subscribe()
        await self._attach_all()

    async def _attach_all(self) -> None:
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.queue.put_nowait((await sub.attach())[0])

    async def _run(self) -> None:
        pause = FIRST_PAUSE_S
        while not self._stopping:
            try:
                if self._lost or self._pubsub is None:
                    await self._recover()
                    if self._lost:
                        logger.info("output feed %s: redis is back", self.reader_id)
                    self._lost = False
                assert self._pubsub is not None
                message = await self._next(self._pubsub, self.block_ms / 1000)
                if message is not None and message["type"] == SUBSCRIBED:
                    # redis-py reconnected and subscribed again by itself: what was published
                    # meanwhile reached no one
                    logger.info("output feed %s: subscribed again", self.reader_id)
                    await self._attach_all()
                    message = None
                elif message is not None and message["type"] == UNSUBSCRIBED:
                    raise RedisError(f"the server dropped the subscription to {self.channel}")
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
            if message is not None and message["type"] == MESSAGE:
                self._dispatch(message["data"])

    def _dispatch(self, packed: bytes) -> None:
        """One feed message (one worker step): each request's chunk to its subscriptions."""
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
    """A process's output readers, one `OutputFeed` per pipeline shard (each shard's channel
    lives on its own node), all under one reader id: a request names that id and
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
