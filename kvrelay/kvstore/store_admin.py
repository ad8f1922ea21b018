"""Start-up, shutdown and operator views of a NodeStore (a mixin; state lives in store.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.kvstore.errors import StoreError
from kvrelay.kvstore.page import verify_page

if TYPE_CHECKING:
    import threading
    from collections import OrderedDict
    from collections.abc import Callable

    from kvrelay.kvstore.arena import HostArena
    from kvrelay.kvstore.disk import DiskTier
    from kvrelay.kvstore.metrics import StoreMetrics
    from kvrelay.kvstore.retention import SessionRetention

logger = logging.getLogger(__name__)

# Why a page was evicted (the `reason` label of kvrelay:store_evictions_total)
CAPACITY = "capacity"  # the least recently used page no session holds
DEMOTED = "demoted"  # a sliding window had left it behind (the engine's demote)
EXPIRED = "expired"  # its session's TTL ended
RETAINED = "retained"  # a live session's page: the tier was full of them
OPERATOR = "operator"  # `kvrelay kv evict`


@dataclass(slots=True)
class Entry:
    """Where a page lives in the arena and who holds it."""

    slot: int
    ready: bool
    deadline: float = 0.0  # reservation lease (writers)
    pins: list[float] = field(default_factory=list)  # reader lease deadlines
    reason: str = CAPACITY  # why it would be evicted (DEMOTED, EXPIRED: first)
    prefetched: bool = False  # brought up by a prefetch and not read since


class StoreAdmin:
    """Rebuild, flush, counts, listing and eviction over NodeStore's index."""

    if TYPE_CHECKING:  # NodeStore's state and helpers (store.py) that these methods use
        arena: HostArena
        disk: DiskTier | None
        metrics: StoreMetrics
        fingerprint: str | None
        page_bytes: int
        on_gone: Callable[[list[bytes]], None]
        lock: threading.RLock
        _entries: dict[bytes, Entry]
        retention: SessionRetention
        _lru: OrderedDict[bytes, None]
        _kept: OrderedDict[bytes, None]
        _free: list[int]
        _slot_key: dict[int, bytes]

        def _gone(self, dropped: list[bytes]) -> None: ...

        def _index(self, key: bytes) -> None: ...

        def _holds(self, key: bytes) -> bool: ...

        def _keep(self, keys: list[bytes]) -> None: ...

    # -- start and stop ---------------------------------------------------------------------
    def rebuild_from_arena(self) -> int:
        """Index the verified pages already in a reused arena file (a node restart)."""
        with self.lock:
            for i in range(self.arena.num_slots):
                try:
                    h = verify_page(
                        self.arena.slot(i), page_bytes=self.page_bytes, fingerprint=self.fingerprint
                    )
                except StoreError:
                    continue
                if h.key in self._entries:
                    continue
                self._free.remove(i)
                self._entries[h.key] = Entry(i, True)
                self._slot_key[i] = h.key
                self._index(h.key)
            return len(self._lru) + len(self._kept)

    def load_retention(self, path: Path) -> int:
        """The sessions a previous run saved (`save_retention`), for the pages still here."""
        import time

        with self.lock:
            n = self.retention.load(path, self._holds, time.time())
            self._keep([k for k in self._lru if self.retention.held(k)])
            return n

    def save_retention(self, path: Path) -> None:
        """Write the session table if it changed (the file outside the lock)."""
        with self.lock:
            if not self.retention.dirty and path.exists():
                return
            data = self.retention.dump()
        try:
            self.retention.save(path, data)
        except OSError:
            self.retention.dirty = True  # try again next time
            raise

    def _arena_keys(self) -> list[bytes]:
        """Ready arena pages in eviction order."""
        return [*self._lru, *self._kept]

    def all_keys(self) -> list[bytes]:
        with self.lock:
            keys = self._arena_keys()
            if self.disk is not None:
                keys += [k for k in self.disk.keys() if k not in self._entries]  # noqa: SIM118
            return keys

    def flush_to_disk(self) -> int:
        """Copy arena pages missing from disk to disk (clean shutdown); returns pages written."""
        if self.disk is None:
            return 0
        n = 0
        with self.lock:
            for key in self._arena_keys():
                if key not in self.disk:
                    self._gone(self.disk.put(key, self.arena.slot(self._entries[key].slot)))
                    n += 1
        return n

    # -- operators --------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        with self.lock:
            pinned = sum(1 for e in self._entries.values() if e.pins)
            on_disk = 0
            if self.disk is not None:
                on_disk = sum(1 for k in self.disk.keys() if self.retention.held(k))  # noqa: SIM118
            return {
                "host": len(self._lru) + len(self._kept),
                "disk": len(self.disk) if self.disk is not None else 0,
                "host_slots": self.arena.num_slots,
                "pinned": pinned,
                "disk_capacity": self.disk.capacity if self.disk is not None else 0,
                "sessions": len(self.retention),
                "retained_host": len(self._kept),
                "retained_disk": on_disk,
            }

    def ls(self, limit: int = 1000) -> dict[str, list[str]]:
        """Keys per tier, least recently used first."""
        with self.lock:
            disk = self.disk.keys() if self.disk is not None else []
            return {
                "host": [k.hex() for k in self._arena_keys()[:limit]],
                "disk": [k.hex() for k in disk[:limit]],
            }

    def evict(self, tier: str) -> int:
        """`host`: demote every unpinned arena page; `all`: also empty the disk tier."""
        if tier not in ("host", "all"):
            raise StoreError(f"evict: tier must be host or all, got {tier!r}")
        n = 0
        with self.lock:
            if tier == "all":
                self.retention.clear()
            for key in [k for k in self._arena_keys() if not self._entries[k].pins]:
                e = self._entries.pop(key)
                self._lru.pop(key, None)
                self._kept.pop(key, None)
                if self.disk is not None and tier == "host":
                    self._gone(self.disk.put(key, self.arena.slot(e.slot), sync=False))
                elif self.disk is None or key not in self.disk:
                    self.on_gone([key])
                self._free.append(e.slot)
                self.metrics.inc("evictions", "host", OPERATOR)
                n += 1
            if tier == "all" and self.disk is not None:
                dropped = self.disk.keys()
                for key in dropped:
                    self.disk.remove(key)
                self.metrics.inc("evictions", "disk", OPERATOR, value=len(dropped))
                gone = [k for k in dropped if k not in self._entries]
                if gone:
                    self.on_gone(gone)
                n += len(dropped)
        return n
