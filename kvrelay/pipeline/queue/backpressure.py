"""Refuse new requests (429 + Retry-After) while the work streams are backed up.

Two bounds. Requests this ingress is serving (`max_inflight`): a request takes its in-flight
slot in the same step as the check (no await between), so a burst cannot all pass the check
before any of them is counted; the slot is given back exactly once on every exit. Entries no
worker has read yet (`max_waiting`): checked here against the last snapshot of the stream lag
(plus what this ingress queued since), which refuses early, before a request is tokenized; the
exact check is made again by the submit script in Redis as the entry is added
(`submit._SUBMIT_LUA`), because concurrent requests all read the same snapshot. With Redis
unreachable (restarting) there is no snapshot: the request is admitted, to wait for Redis in
the submission, where that exact check is made.

A request answered by several choices (n, best_of, a list of prompts) counts as that many
requests against both bounds, except that it is never refused by an idle ingress or an empty
queue (else one with more choices than a bound could never run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from redis.exceptions import ConnectionError as RedisConnectionError

from kvrelay.pipeline.errors import overloaded
from kvrelay.pipeline.queue.cluster import ClusterState

logger = logging.getLogger(__name__)


class Backpressure:
    """Admission control for one ingress process."""

    def __init__(
        self,
        cluster: ClusterState,
        max_waiting: int,
        max_inflight: int,
        retry_after_s: int = 1,
    ):
        self.cluster = cluster
        self.max_waiting, self.max_inflight = max_waiting, max_inflight
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self._queued_since = 0
        self._snapshot_age = -1.0

    async def waiting(self, pipeline: str | None = None) -> int:
        """Undelivered entries in both work streams, as best known now: of one model's
        `pipeline` (the bound the submit script applies is per model), or of every model."""
        load = await self.cluster.load()
        age = self.cluster.load_age_s
        if age < self._snapshot_age:  # a fresh snapshot already counts what we queued
            self._queued_since = 0
        self._snapshot_age = age
        if pipeline is not None and len(self.cluster.pipeline_loads) > 1:
            load = self.cluster.pipeline_loads.get(pipeline, load)
        return sum(s.waiting for s in load.values()) + self._queued_since

    def slot(self, count: int = 1) -> Slot:
        """Count an open request (of `count` choices) without checking the bound (a
        reattaching client)."""
        self.inflight += count
        return Slot(self, count)

    async def admit(self, count: int = 1, pipeline: str | None = None) -> Slot:
        """Take in-flight slots for a new request of `count` choices, or raise a 429 (the
        waiting bound counted on its model's `pipeline`; None: every model's)."""
        if _over(self.inflight, count, self.max_inflight):
            raise overloaded(f"{self.inflight} requests in flight", self.retry_after_s)
        # taken before the first await: the check and the count are one step
        slot = self.slot(count)
        try:
            waiting = await self.waiting(pipeline)
        except RedisConnectionError:
            return slot  # restarting: the submit script checks the bound once Redis is back
        except BaseException:
            slot.release()
            raise
        if _over(waiting, count, self.max_waiting):
            slot.release()
            logger.warning(
                "refusing a request: %d queued entries (bound %d)", waiting, self.max_waiting
            )
            raise overloaded(f"{waiting} requests waiting for a worker", self.retry_after_s)
        return slot

    def queued(self, count: int = 1) -> None:
        """Count a request (of `count` choices) this ingress just queued."""
        self._queued_since += count


def _over(current: int, count: int, bound: int) -> bool:
    """Whether `count` more would pass `bound` (never when there are none yet)."""
    return current >= bound or (current > 0 and current + count > bound)


class Slot:
    """One request's in-flight places; release() is idempotent."""

    __slots__ = ("_count", "_owner", "_then")

    def __init__(self, owner: Backpressure, count: int = 1):
        self._owner: Backpressure | None = owner
        self._count = count
        self._then: list[Callable[[], None]] = []

    def then(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the slot is released (what else the request holds till its
        reply ends: a quota unit); at once when it was."""
        if self._owner is None:
            callback()
        else:
            self._then.append(callback)

    def release(self) -> None:
        if self._owner is not None:
            self._owner.inflight -= self._count
            self._owner = None
            callbacks, self._then = self._then, []
            for callback in callbacks:
                callback()
