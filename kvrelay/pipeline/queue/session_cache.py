"""SessionCache: what the producer asks of the page store for a request it queues.

Two things, both decided at the queue, before any worker reads the request:
- retention: a request naming a session (`prompt_cache_key`, else `user`; a Responses chain)
  carries `Retention(session, ttl_s)` in its task; the worker that finishes it asks its store
  node to keep the session's pages that long (`prompt_cache_retention`: "in_memory" or unset is
  `retention_s`, "24h" a day, or seconds; above `max_retention_s` is refused with a 400);
- prefetch: once queued, the keys of the prompt's full pages are published as a
  `PrefetchHint`; store nodes of the model bring those they hold on disk (or a peer holds) into
  their arena while the request waits, so the worker that admits it loads from memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvrelay.core.keys import Keys
from kvrelay.core.messages import Retention
from kvrelay.core.page_keys import MAX_HINT_KEYS, PrefetchHint, page_keys
from kvrelay.pipeline.errors import bad_request
from kvrelay.pipeline.model_registry import ModelEntry
from kvrelay.pipeline.queue.redis_options import AsyncRedis

logger = logging.getLogger(__name__)

DAY_S = 86400
UNNAMED = "(unnamed)"  # the session of a retention asked for without a key or user
PARAM = "prompt_cache_retention"


class SessionCache:
    """Retention of named sessions and prefetch hints, for one producer."""

    def __init__(
        self,
        redis: AsyncRedis,
        keys: Keys,
        retention_s: float = 600.0,
        max_retention_s: float = DAY_S,
        prefetch: bool = True,
    ):
        self.redis, self.keys = redis, keys
        self.retention_s, self.max_retention_s = retention_s, max_retention_s
        self.prefetch = prefetch

    def retention(self, session: str | None, asked: str | int | None) -> Retention | None:
        """The retention of a request naming `session` and asking `asked`; None when it
        names no session and asks nothing. A RequestError (400) past the bound."""
        if session is None and asked is None:
            return None
        if asked is None or asked == "in_memory":
            ttl = self.retention_s
        elif asked == "24h":
            ttl = DAY_S
        elif isinstance(asked, int) and not isinstance(asked, bool):
            ttl = asked
        else:
            raise bad_request(f"{PARAM} must be 'in_memory', '24h' or seconds", param=PARAM)
        if ttl > self.max_retention_s:
            raise bad_request(
                f"{PARAM} of {ttl:g} seconds is more than this server retains "
                f"({self.max_retention_s:g} seconds at most)",
                param=PARAM,
            )
        return Retention(session=(session or UNNAMED)[:256], ttl_s=float(ttl))

    async def hint(self, entry: ModelEntry, prompt_ids: Sequence[int], salt: str) -> None:
        """Publish the prompt's page keys for the store nodes to bring up (a hint: Redis
        failing costs a slower load, never the request)."""
        if not self.prefetch or not entry.fingerprint or len(prompt_ids) <= entry.page_size:
            return
        # the engine computes the last prompt token itself: a page ending on it is never read
        keys = page_keys(prompt_ids[:-1], entry.page_size, entry.fingerprint, salt)
        if not keys:
            return
        hint = PrefetchHint(entry.fingerprint, keys[:MAX_HINT_KEYS])
        try:
            await self.redis.publish(self.keys.prefetch, hint.encode())
        except Exception as exc:  # noqa: BLE001 - a hint only
            logger.debug("prefetch hint not published: %r", exc)
