"""Cached snapshots of what the workers publish: served models, live workers, stream lag.

The ingress consults these on every request (routing, backpressure, /health), so each is
fetched at most once per `refresh_s` and shared by all concurrent requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from redis.exceptions import ResponseError

from kvrelay.core.enums import Stage
from kvrelay.core.keys import DECODE_GROUP, PREFILL_GROUP, WAIT_SET, Keys
from kvrelay.core.model_bundle import PUBLICATION_TTL_S
from kvrelay.core.published_model import PublishedModel
from kvrelay.core.record import as_str
from kvrelay.core.worker_record import WorkerRecord
from kvrelay.pipeline.queue.redis_options import AsyncRedis
from kvrelay.pipeline.queue.replies import StreamEntry

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class WorkerInfo:
    """One live worker, from its `worker:{id}` heartbeat hash."""

    worker_id: str
    record: WorkerRecord

    @property
    def role(self) -> str:
        return str(self.record.role)

    @property
    def model(self) -> str:
        return self.record.model


@dataclass(slots=True)
class StreamLoad:
    """Entries nobody has read yet (`waiting`) and read but not acked (`pending`)."""

    waiting: int = 0
    pending: int = 0


def _serves(workers: list[WorkerInfo], model: str) -> bool:
    """Whether a live, non-draining worker serves `model` (one not saying which counts), or
    no worker takes new entries at all (then every model waits alike, as with one model)."""
    live = [w for w in workers if not w.record.stopped]
    return not live or any(not w.model or w.model == model for w in live)


class _Cached(Generic[T]):
    """A value refreshed by `fetch` when older than `ttl_s`; callers share one fetch in flight."""

    def __init__(self, fetch: Callable[[], Awaitable[T]], ttl_s: float, stale_s: float = 0.0):
        # up to `stale_s` past its ttl a value is still served; prefetch() refreshes it
        self._fetch, self._ttl, self._stale_s = fetch, ttl_s, stale_s
        self._value: T | None = None
        self._at = -1e18
        self._task: asyncio.Task[T] | None = None

    def _stale(self) -> bool:
        return self._value is None or time.monotonic() - self._at > self._ttl

    def prefetch(self, only_if_blocking: bool = False) -> None:
        """Start a refresh now if the value is stale, so a later get() finds it done or going.

        `only_if_blocking`: only when get() would have to wait for it (no servable value).
        """
        blocking = not only_if_blocking or not self._servable()
        if self._task is None and self._stale() and blocking:
            self._start()

    @property
    def serves_stale(self) -> bool:
        return self._stale_s > 0

    def _servable(self) -> bool:
        return self._value is not None and self.age_s <= self._ttl + self._stale_s

    def _start(self) -> asyncio.Task[T]:
        task = asyncio.create_task(self._refresh())
        self._task = task
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[T]) -> None:
        if self._task is task:
            self._task = None
        if not task.cancelled():
            task.exception()  # retrieved: a request that failed early never awaited it

    async def _refresh(self) -> T:
        value = await self._fetch()
        self._value, self._at = value, time.monotonic()
        return value

    async def get(self, fresh: bool = False) -> T:
        if fresh:
            if self._task is not None:
                await asyncio.shield(self._task)  # let a running refresh land first
            return await asyncio.shield(self._start())
        if self._task is None and not self._stale():
            return cast(T, self._value)  # not stale: a value is held
        if self._servable():
            return cast(
                T, self._value
            )  # refreshed by prefetch(), called once the request is queued
        # shield: one caller going away must not cancel the fetch the others wait for
        return await asyncio.shield(self._task or self._start())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def peek(self) -> T | None:
        """The value held now, however old (None before the first fetch)."""
        return self._value

    @property
    def age_s(self) -> float:
        return time.monotonic() - self._at


class ClusterState:
    """Models, workers and stream load as last seen in Redis."""

    def __init__(
        self,
        redis: AsyncRedis,
        keys: Keys,
        refresh_s: float = 0.25,
        pipelines: tuple[str, ...] | list[str] = ("",),
    ):
        self.redis, self.keys = redis, keys
        self.refresh_s = refresh_s
        # the model pipelines whose streams the load sums (`core.keys`; "" the unnamed one)
        self.pipelines = list(dict.fromkeys(pipelines)) or [""]
        # each pipeline's stream load summed over the shards, as of the last load snapshot
        self.pipeline_loads: dict[str, dict[str, StreamLoad]] = {}
        self._models = _Cached(self._fetch_models, refresh_s)
        # SCANning for heartbeats walks the whole keyspace (page directory included), which
        # takes milliseconds: refresh less often, and behind the requests rather than before
        # them: heartbeats live 30 s, so a snapshot up to that old tells little less)
        self._workers = _Cached(self._fetch_workers, refresh_s * 4, stale_s=refresh_s * 120)
        self._load = _Cached(self._fetch_load, refresh_s)

    def prefetch(self, workers: bool = True) -> None:
        """Start refreshing the stale snapshots a request will need, all at once."""
        self._models.prefetch()
        self._load.prefetch()
        if workers:
            # a servable snapshot is refreshed by refresh_behind(), once the request is queued
            self._workers.prefetch(only_if_blocking=True)

    def refresh_behind(self) -> None:
        """Refresh stale snapshots that were served anyway (call when a request is queued)."""
        if self._workers.serves_stale:
            self._workers.prefetch()

    def close(self) -> None:
        for cached in (self._models, self._workers, self._load):
            cached.close()

    async def models(self, fresh: bool = False) -> dict[str, PublishedModel]:
        """Model name -> what its workers publish (`kvrelay.workers.publication`)."""
        return await self._models.get(fresh)

    async def workers(self, fresh: bool = False) -> list[WorkerInfo]:
        return await self._workers.get(fresh)

    async def load(self, fresh: bool = False) -> dict[str, StreamLoad]:
        """`prefill` and `decode` stream load."""
        return await self._load.get(fresh)

    @property
    def load_age_s(self) -> float:
        """Seconds since the stream load snapshot was taken."""
        return self._load.age_s

    async def roles(self, model: str) -> dict[str, int]:
        """Live, not draining workers serving `model` (or not saying which), by role."""
        counts: dict[str, int] = {}
        for w in await self.workers():
            if w.record.draining:
                continue  # finishing its work, taking no more
            if not w.model or w.model == model:
                counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def published_now(self) -> dict[str, PublishedModel]:
        """The last models snapshot, without fetching ({} before the first)."""
        return self._models.peek() or {}

    async def serving(self, model: str) -> bool:
        """False when live workers run but none of them serves `model` (all of its own are
        stopped, draining or gone): its requests would wait for a worker that may never come.
        True when one does, or when no worker is live at all (a stack starting or restarting
        as a whole queues its requests, as a single-model stack always did)."""
        workers = await self.workers()
        if _serves(workers, model):
            return True
        if self._workers.age_s > self.refresh_s:  # a snapshot served stale: look again
            workers = await self.workers(fresh=True)
        return _serves(workers, model)

    async def _fetch_models(self) -> dict[str, PublishedModel]:
        out: dict[str, PublishedModel] = {}
        now = time.time()
        for key, raw in (await self.redis.hgetall(self.keys.models)).items():
            name = as_str(key)
            entry = PublishedModel.decode(raw, name)
            if entry is None:
                logger.warning("ignoring unreadable models entry %r", name)
                continue
            if entry.stale(now, PUBLICATION_TTL_S):
                continue  # no worker has served it for a week (its files have expired too)
            out[name] = entry
        return out

    async def _fetch_workers(self) -> list[WorkerInfo]:
        # a worker beats on every shard it serves: one record per worker (its lowest shard's)
        found: dict[str, WorkerInfo] = {}
        for keys in self.keys.all():
            pattern = keys.worker_pattern
            names = [k async for k in self.redis.scan_iter(match=pattern, count=1000)]
            if not names:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.hgetall(name)
            prefix = len(keys.worker(""))
            for name, raw in zip(names, await pipe.execute(), strict=True):
                record = WorkerRecord.decode(raw)
                if record is None:  # expired between SCAN and HGETALL
                    continue
                worker = as_str(name)[prefix:]
                found.setdefault(worker, WorkerInfo(worker, record))
        return list(found.values())

    async def _fetch_load(self) -> dict[str, StreamLoad]:
        """Each stage's load summed over the shards (`shard_load` has them one by one)."""
        out: dict[str, StreamLoad] = {}
        for shard in await self.shard_load():
            for name, load in shard.items():
                total = out.setdefault(name, StreamLoad())
                total.waiting += load.waiting
                total.pending += load.pending
        return out

    async def shard_load(self) -> list[dict[str, StreamLoad]]:
        """`prefill` and `decode` stream load of every shard, shard 0 first (each summed over
        the model pipelines; `pipeline_load` has them one by one)."""
        out: list[dict[str, StreamLoad]] = []
        published = [m.pipeline or "" for m in (await self.models()).values()]
        by_pipeline: dict[str, dict[str, StreamLoad]] = {}
        for pipeline in dict.fromkeys([*self.pipelines, *published]):
            loads = await self.pipeline_load(pipeline)
            own = by_pipeline[pipeline] = {}
            for shard in loads:
                for name, one in shard.items():
                    summed = own.setdefault(name, StreamLoad())
                    summed.waiting += one.waiting
                    summed.pending += one.pending
            if not out:
                out = loads
                continue
            for total, load in zip(out, loads, strict=True):
                for name, one in load.items():
                    total[name].waiting += one.waiting
                    total[name].pending += one.pending
        self.pipeline_loads = by_pipeline
        return out

    async def pipeline_load(self, pipeline: str = "") -> list[dict[str, StreamLoad]]:
        """`prefill` and `decode` stream load of one model pipeline on every shard."""
        # one round trip for every stream; a stream that does not exist yet answers an error
        pipe = self.redis.pipeline(transaction=False)
        stages = ((Stage.PREFILL, PREFILL_GROUP), (Stage.DECODE, DECODE_GROUP))
        shards = [keys.for_pipeline(pipeline) for keys in self.keys.all()]
        for keys in shards:
            for stream in (keys.prefill_stream, keys.decode_stream):
                pipe.xinfo_groups(stream)
                pipe.xlen(stream)
                pipe.hlen(stream + WAIT_SET)  # --scheduling-policy priority's wait set
        replies = await pipe.execute(raise_on_error=False)
        loads: list[dict[str, StreamLoad]] = []
        for k, keys in enumerate(shards):
            streams = (keys.prefill_stream, keys.decode_stream)
            out: dict[str, StreamLoad] = {}
            for i, (name, group) in enumerate(stages):
                at = 6 * k + 3 * i
                groups, length, ordered = replies[at : at + 3]
                load = await self._stream_load(streams[i], group, groups, length)
                if isinstance(ordered, int):
                    load.waiting += ordered
                out[name] = load
            loads.append(out)
        return loads

    async def _stream_load(self, stream: str, group: str, groups: Any, length: Any) -> StreamLoad:
        if isinstance(groups, ResponseError):  # no such stream: nothing queued
            return StreamLoad()
        if isinstance(groups, Exception):
            raise groups
        info = next((g for g in groups if as_str(g["name"]) == group), None)
        if info is None:  # no consumer ever joined: everything queued is waiting
            return StreamLoad(waiting=int(length))
        lag = info.get("lag")
        if lag is None:
            # Redis cannot tell after deletions; count what lies past the last delivered id.
            last = as_str(info["last-delivered-id"])
            rows = await self.redis.xrange(stream, min="(" + last, count=10000)
            lag = len(cast("list[StreamEntry]", rows))
        return StreamLoad(waiting=int(lag), pending=int(info.get("pending") or 0))
