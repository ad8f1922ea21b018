"""Waiting out a Redis outage instead of failing: the output readers and request submission.

A Valkey restart (supervisord brings it back in well under a second, then it answers LOADING,
a ConnectionError too, while it reads its append-only file) must cost a client time, not an
error. Each caller tracks its own outage: it is waited out, retrying with a growing pause, for
up to REDIS_RETRY_S (and never past the request's deadline); longer, the error is raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError

logger = logging.getLogger(__name__)

T = TypeVar("T")

REDIS_RETRY_S = 30.0  # the default bound: the readers' and the ingress's `submit_wait_s`
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 0.25


@dataclass(slots=True)
class Outage:
    """One stretch of Redis unreachability seen by `what` (e.g. "request r-1")."""

    what: str
    limit_s: float = REDIS_RETRY_S
    deadline: float | None = None  # unix seconds: no waiting past it
    since: float | None = None  # monotonic time of the first failure; None: Redis answers
    pause_s: float = FIRST_PAUSE_S

    async def wait(self, exc: BaseException) -> bool:
        """After a failed try: pause and return True, or False when the outage is too long."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
            logger.warning("%s: redis unavailable (%s); waiting", self.what, exc)
        left = self.limit_s - (now - self.since)
        if self.deadline is not None:
            left = min(left, self.deadline - time.time())
        if left <= 0:
            return False
        await asyncio.sleep(min(self.pause_s, left))
        self.pause_s = min(self.pause_s * 2, MAX_PAUSE_S)
        return True

    def over(self) -> None:
        """Redis answered: the outage (if any) ended."""
        if self.since is not None:
            logger.info("%s: redis back after %.1fs", self.what, time.monotonic() - self.since)
            self.since, self.pause_s = None, FIRST_PAUSE_S

    async def retry(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()`, tried again while it fails to reach Redis (ConnectionError only: a
        command that timed out may still be running, and a hung Redis should fail fast)."""
        while True:
            try:
                result = await attempt()
            except RedisConnectionError as exc:
                if not await self.wait(exc):
                    raise
                continue
            self.over()
            return result
