"""Refuse new requests (429 + Retry-After) while the work streams are backed up.

The bound is on entries no worker has read yet (stream lag of the prefill and decode groups),
plus requests this ingress queued since the last snapshot, so a burst between two snapshots
cannot overshoot; and on requests this ingress is currently serving.
"""

from __future__ import annotations

import logging

from kvrelay.pipeline.cluster import ClusterState
from kvrelay.pipeline.errors import overloaded

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

    async def waiting(self) -> int:
        """Undelivered entries in both work streams, as best known now."""
        load = await self.cluster.load()
        age = self.cluster.load_age_s
        if age < self._snapshot_age:  # a fresh snapshot already counts what we queued
            self._queued_since = 0
        self._snapshot_age = age
        return sum(s.waiting for s in load.values()) + self._queued_since

    async def check(self) -> None:
        """Raise a 429 RequestError when a bound is exceeded."""
        if self.inflight >= self.max_inflight:
            raise overloaded(f"{self.inflight} requests in flight", self.retry_after_s)
        waiting = await self.waiting()
        if waiting >= self.max_waiting:
            logger.warning(
                "refusing a request: %d queued entries (bound %d)", waiting, self.max_waiting
            )
            raise overloaded(f"{waiting} requests waiting for a worker", self.retry_after_s)

    def queued(self) -> None:
        """Count a request this ingress just queued."""
        self._queued_since += 1
