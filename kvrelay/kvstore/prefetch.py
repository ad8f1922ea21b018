"""Prefetcher: a store node's listener for prefetch hints, and the thread that acts on them.

The ingress knows a request's prompt, hence its page keys, the moment it queues it, before any
worker reads it; it publishes them (`core.page_keys.PrefetchHint` on `Keys.prefetch`). Every
store node of that model brings the leading pages it holds on disk into its arena (with
`--prefetch remote`, also those a peer holds), so the worker that admits the request loads
from memory while the queue wait has paid for the disk read. A hint is only a hint: one lost
(Redis away, the queue of hints full) costs a slower load, never a wrong one.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from kvrelay.core.page_keys import PrefetchHint

logger = logging.getLogger(__name__)

MAX_QUEUED = 64  # hints waiting to be acted on; beyond, the oldest are dropped
RETRY_S = 1.0  # pause before subscribing again after Redis failed


class Prefetcher:
    """Subscribes to the hints of one model and prefetches their pages, one hint at a time."""

    def __init__(
        self,
        redis,
        channel: str,
        fingerprint: str | None,
        prefetch: Callable[[list[bytes]], object],
    ):
        self.redis, self.channel, self.fingerprint = redis, channel, fingerprint
        self._prefetch = prefetch
        self._hints: collections.deque[list[bytes]] = collections.deque(maxlen=MAX_QUEUED)
        self._ready = threading.Condition()
        self._stop = threading.Event()
        self._pubsub = None
        self._threads = [
            threading.Thread(target=self._listen, name="kv-hints", daemon=True),
            threading.Thread(target=self._work, name="kv-prefetch", daemon=True),
        ]
        self.subscribed = threading.Event()  # set once listening (tests wait for it)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        with self._ready:
            self._ready.notify_all()
        for t in self._threads:
            t.join(timeout=2)

    def offer(self, data: bytes) -> bool:
        """Queue the hint in `data` if it is one for this node's model."""
        hint = PrefetchHint.decode(data)
        if hint is None or not hint.keys:
            return False
        if self.fingerprint is not None and hint.fingerprint != self.fingerprint:
            return False
        with self._ready:
            self._hints.append(hint.keys)
            self._ready.notify()
        return True

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                self.subscribed.set()
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg is not None and isinstance(msg.get("data"), bytes):
                        self.offer(msg["data"])
                pubsub.close()
            except Exception as exc:  # noqa: BLE001 - Redis away: hints wait for it
                self.subscribed.clear()
                logger.debug("prefetch hints unavailable (%s); retrying", exc)
                self._stop.wait(RETRY_S)

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._hints and not self._stop.is_set():
                    self._ready.wait()
                if self._stop.is_set():
                    return
                keys = self._hints.popleft()
            try:
                self._prefetch(keys)
            except Exception:  # a hint failing costs a slower load only
                logger.exception("prefetch of %d pages failed", len(keys))
