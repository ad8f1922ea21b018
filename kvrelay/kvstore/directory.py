"""The page directory in Redis: `node:{id}` (addresses, TTL heartbeat) and the `pages` hash
(page key hex -> the node ids holding it). Writes are batched by a background thread, one
script call per flush however many pages (`lua/pages.lua`), so the request path never waits on
Redis; reads (`locate`, one HMGET) happen only on a local miss.

A new entry wakes the thread at once (what queues while a flush is in flight goes in the next
one): a prefill worker hands a request off right after its pages are committed, and a decode
worker on another host finds them only through this hash. Waiting for a timer here let the
hand-off overtake the entries, and the decode worker recomputed the whole prompt.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from importlib import resources
from typing import cast

from kvrelay.core.keys import Keys
from kvrelay.core.page_keys import holders

FLUSH_S = 0.25  # the thread's idle tick (heartbeat check), and its pause after a failed flush

logger = logging.getLogger(__name__)


class Directory:
    """Registration, heartbeat and page-location entries of one store node."""

    def __init__(
        self,
        redis_url: str,
        key_prefix: str,
        node_id: str,
        ttl_s: float = 10.0,
        heartbeat_s: float = 2.0,
        shards: int = 1,
    ):
        from kvrelay.core.redis_client import sync_redis

        self.redis = sync_redis(redis_url, socket_timeout=5, socket_connect_timeout=5)
        script = resources.files("kvrelay.kvstore") / "lua" / "pages.lua"
        self._pages = self.redis.register_script(script.read_text())
        self.keys = Keys(key_prefix, shards=shards)  # page entries spread over the shards
        self.node_id = node_id
        self.ttl_s, self.heartbeat_s = ttl_s, heartbeat_s
        self._info: dict[str, str] = {}
        self._ops: queue.Queue = queue.Queue()
        # one flush at a time: a caller waits for the flush in flight (which may hold its ops)
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by add()/remove() and stop()
        self._nodes: dict[str, tuple[float, dict[str, str] | None]] = {}
        self._thread = threading.Thread(target=self._run, name="kv-directory", daemon=True)

    def start(self, info: Mapping[str, object], keys: list[bytes]) -> None:
        """Register this node and announce the pages it already holds."""
        self._info = {k: str(v) for k, v in info.items()}
        self._heartbeat()
        self.add(keys)
        self._thread.start()

    def stop(self) -> None:
        """Flush pending entries and unregister (page entries stay; peers skip dead nodes)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self._flush()
            self.redis.delete(self.keys.store_node(self.node_id))
        except Exception as exc:  # noqa: BLE001 - Redis being down must not block shutdown
            logger.warning("could not flush or unregister store node %s: %s", self.node_id, exc)
        self.redis.close()

    def add(self, keys: list[bytes]) -> None:
        if keys:
            self._ops.put(("add", keys))
            self._wake.set()

    def remove(self, keys: list[bytes], node_id: str | None = None) -> None:
        if keys:
            self._ops.put(("rem", keys, node_id or self.node_id))
            self._wake.set()

    def _heartbeat(self) -> None:
        name = self.keys.store_node(self.node_id)
        pipe = self.redis.pipeline(transaction=False)
        fields = {**self._info, "updated": f"{time.time():.3f}"}
        # redis-py types `mapping` with invariant keys (Mapping[EncodableT, ...]): str keys fail
        pipe.hset(name, mapping=fields)  # type: ignore[arg-type]
        pipe.pexpire(name, int(self.ttl_s * 1000))
        pipe.execute()

    def _flush(self) -> None:
        """Write every queued op; when it returns, what was queued before the call is written
        (by this call or by the flush that was in flight)."""
        with self._flush_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        ops = []
        while True:
            try:
                ops.append(self._ops.get_nowait())
            except queue.Empty:
                break
        if not ops:
            return
        # per `pages` hash (one per shard, by page key): one script call each
        added: dict[str, set[str]] = {}
        removed: dict[str, list[str]] = {}
        for op in ops:
            for key in op[1]:
                page_hex = key.hex()
                pages = self.keys.pages_of(page_hex)
                if op[0] == "add":
                    added.setdefault(pages, set()).add(page_hex)
                else:
                    removed.setdefault(pages, []).extend([page_hex, op[2]])
        for pages in sorted(set(added) | set(removed)):
            adds, rems = added.get(pages, set()), removed.get(pages, [])
            self._pages(keys=[pages], args=[self.node_id, len(adds), *adds, *rems])

    def _run(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_s
        while not self._stop.is_set():
            self._wake.clear()  # before the flush: an entry queued during it wakes the next
            try:
                self._flush()
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + self.heartbeat_s
            except Exception as exc:  # noqa: BLE001 - keep serving locally while Redis is down
                logger.warning("page directory update failed: %s", exc)
                self._stop.wait(FLUSH_S)  # a retry pace, not one warning per new entry
                continue
            self._wake.wait(FLUSH_S)

    def locate(self, keys: list[bytes]) -> list[list[str]]:
        """Node ids (other than this one, alive) holding each key."""
        if not keys:
            return []
        hexes = [key.hex() for key in keys]
        values: list[bytes | None] = [None] * len(hexes)
        for pages, positions in self.keys.page_groups(hexes).items():
            found = self.redis.hmget(pages, [hexes[i] for i in positions])
            for i, value in zip(positions, cast("list[bytes | None]", found), strict=True):
                values[i] = value
        out = []
        for value in values:
            ids = sorted(i for i in holders(value) if i != self.node_id)
            out.append([i for i in ids if self.node_info(i) is not None])
        return out

    def node_info(self, node_id: str) -> dict[str, str] | None:
        """A peer's registration (addresses), cached for one second; None if it is not alive."""
        now = time.monotonic()
        cached = self._nodes.get(node_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        # bytes: the client does not decode responses
        raw = cast("dict[bytes, bytes]", self.redis.hgetall(self.keys.store_node(node_id)))
        info = {k.decode(): v.decode() for k, v in raw.items()} or None
        self._nodes[node_id] = (now + 1.0, info)
        return info
