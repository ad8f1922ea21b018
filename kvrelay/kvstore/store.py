"""NodeStore: the store node's index over its tiers (host arena, then disk), thread-safe.

A page moves through: put -> reserved slot (writer copies bytes in) -> commit (ready, LRU) ->
evicted from the arena (demoted to disk, or gone) -> evicted from disk (gone). Lookups walk
host -> disk (-> remote, driven by the server) and promote disk hits into the arena. A slot being
read is pinned and is never evicted or reused under its reader; pins and reservations expire
after `pin_timeout_s` so a crashed worker cannot leak slots.

Eviction follows expected reuse, then recency: the arena evicts first the pages nobody expects
back (a sliding window's pages behind it, `demote`; a session's whose TTL ended), then the
other pages no session holds (LRU), and only then the pages a live session retains
(`retention.SessionRetention`: LRU among them; they go to disk, where they are kept while any
page no session holds can go). `prefetch` brings a queued request's pages up from disk (and
the server's from peers) before a worker asks; the first `acquire` of such a page counts a
prefetch hit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvrelay.kvstore.arena import HostArena
from kvrelay.kvstore.disk import DiskTier
from kvrelay.kvstore.errors import IncompatiblePageError, PageFormatError, StoreError
from kvrelay.kvstore.metrics import StoreMetrics
from kvrelay.kvstore.page import unpack_header, verify_page
from kvrelay.kvstore.retention import MAX_TTL_S, SessionRetention
from kvrelay.kvstore.store_admin import CAPACITY, DEMOTED, EXPIRED, RETAINED, Entry, StoreAdmin

logger = logging.getLogger(__name__)


class NodeStore(StoreAdmin):
    """Which key is in which arena slot, the disk tier, LRU eviction and pins."""

    def __init__(
        self,
        arena: HostArena,
        disk: DiskTier | None,
        metrics: StoreMetrics,
        fingerprint: str | None = None,
        pin_timeout_s: float = 60.0,
        on_present: Callable[[list[bytes]], None] = lambda keys: None,
        on_gone: Callable[[list[bytes]], None] = lambda keys: None,
        retention: SessionRetention | None = None,
    ):
        self.arena, self.disk, self.metrics = arena, disk, metrics
        self.retention = retention if retention is not None else SessionRetention(MAX_TTL_S)
        if disk is not None:
            disk.keep = self.retention.held  # the disk tier drops a retained page last
        self.fingerprint = fingerprint
        self.page_bytes = arena.page_bytes
        self.pin_timeout_s = pin_timeout_s
        self.on_present, self.on_gone = on_present, on_gone
        self.lock = threading.RLock()
        self._written = threading.Condition(self.lock)  # notified when reservations end
        self._entries: dict[bytes, Entry] = {}
        # ready arena pages, oldest first: those no live session holds, and those one does
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._kept: OrderedDict[bytes, None] = OrderedDict()
        self._free = list(range(arena.num_slots - 1, -1, -1))
        self._slot_key: dict[int, bytes] = {}  # last key placed in each slot (checked on use)
        self._next_expiry = 0.0

    # -- slots ------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        if now < self._next_expiry:
            return
        self._next_expiry = now + 1.0
        for key in self.retention.expire(time.time()):
            if key in self._kept:  # no session expects it back: among the first to go
                del self._kept[key]
                self._lru[key] = None
                self._lru.move_to_end(key, last=False)
                self._entries[key].reason = EXPIRED
        for key, e in list(self._entries.items()):
            if e.pins and e.pins[0] < now:
                e.pins = [d for d in e.pins if d >= now]
                logger.warning("page %s: a reader held its slot past the lease", key.hex())
            if not e.ready and e.deadline < now:
                logger.warning("page %s: writer never committed; slot freed", key.hex())
                del self._entries[key]
                self._free.append(e.slot)

    def _gone(self, dropped: list[bytes]) -> None:
        """Pages the disk tier dropped; those not in the arena either have left this node."""
        if dropped:
            held = sum(map(self.retention.held, dropped))
            if held:
                self.metrics.inc("evictions", "disk", RETAINED, value=held)
            if len(dropped) > held:
                self.metrics.inc("evictions", "disk", CAPACITY, value=len(dropped) - held)
            gone = [k for k in dropped if k not in self._entries]
            if gone:
                self.retention.forget(gone)
                self.on_gone(gone)

    def _index(self, key: bytes) -> None:
        """A page ready in the arena joins its eviction order (most recent)."""
        (self._kept if self.retention.held(key) else self._lru)[key] = None

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for order in (self._lru, self._kept):
            for key in order:
                e = self._entries[key]
                if e.pins:
                    continue
                del order[key]
                del self._entries[key]
                reason = e.reason if order is self._lru else RETAINED
                self.metrics.inc("evictions", "host", reason)
                if e.prefetched:
                    self.metrics.inc("prefetch_unused")
                if self.disk is not None:
                    if key not in self.disk:
                        self.metrics.inc("bytes", "disk", "demote", value=self.page_bytes)
                    self._gone(self.disk.put(key, self.arena.slot(e.slot), sync=False))
                else:
                    self.retention.forget([key])
                    self.on_gone([key])
                return e.slot
        return None  # every slot pinned or being written

    def reserve(self, keys: list[bytes]) -> list[int]:
        """A writable slot per key, or -1 where the page exists already (write-once) or no room."""
        now = time.monotonic()
        out = []
        with self.lock:
            self._expire(now)
            for key in keys:
                if key in self._entries or (self.disk is not None and key in self.disk):
                    out.append(-1)
                    continue
                slot = self._take_slot()
                if slot is None:
                    logger.warning("arena full of pinned pages; not storing %s", key.hex())
                    out.append(-1)
                    continue
                self._entries[key] = Entry(slot, False, now + self.pin_timeout_s)
                self._slot_key[slot] = key
                out.append(slot)
        return out

    def commit(
        self,
        keys: list[bytes],
        slots: list[int],
        pin: bool = False,
        verify: bool = False,
        kind: str = "put",
    ) -> list[str | None]:
        """Publish written slots; per key None or why it was refused (its slot is freed)."""
        errors: list[str | None] = []
        present = []
        # Check outside the lock (CRCs take a while): a reserved slot is its writer's alone.
        problems = [
            self._check_slot(key, slot, verify) for key, slot in zip(keys, slots, strict=True)
        ]
        now = time.monotonic()
        with self.lock:
            for key, slot, problem in zip(keys, slots, problems, strict=True):
                e = self._entries.get(key)
                if e is None or e.ready or e.slot != slot:
                    errors.append(f"page {key.hex()}: no reservation for slot {slot} (expired?)")
                    continue
                if problem is not None:
                    del self._entries[key]
                    self._free.append(slot)
                    errors.append(f"page {key.hex()} refused: {problem}")
                    continue
                e.ready = True
                if pin:
                    e.pins.append(now + self.pin_timeout_s)
                self._index(key)
                present.append(key)
                self.metrics.inc("puts", "host")
                self.metrics.inc("bytes", "host", kind, value=self.page_bytes)
                errors.append(None)
            self._written.notify_all()
        if present:
            self.on_present(present)
        return errors

    def _check_slot(self, key: bytes, slot: int, verify: bool) -> str | None:
        try:
            view = self.arena.slot(slot)
            if verify:
                verify_page(view, key, self.page_bytes, self.fingerprint)
            else:
                h = unpack_header(view)
                if h.key != key:
                    raise PageFormatError(f"slot holds key {h.key.hex()}")
                self._check_header(h)
        except StoreError as exc:
            return str(exc)
        return None

    def _check_header(self, h) -> None:
        if h.payload_bytes != self.page_bytes:
            raise IncompatiblePageError(
                f"page payload is {h.payload_bytes} bytes, this node stores {self.page_bytes}"
            )
        if self.fingerprint is not None and h.fingerprint != self.fingerprint:
            raise IncompatiblePageError(
                f"model fingerprint {h.fingerprint!r} does not match this node's "
                f"{self.fingerprint!r}"
            )

    def abort(self, keys: list[bytes], slots: list[int]) -> None:
        """Free reservations a writer could not fill."""
        with self.lock:
            for key, slot in zip(keys, slots, strict=True):
                e = self._entries.get(key)
                if e is not None and not e.ready and e.slot == slot:
                    del self._entries[key]
                    self._free.append(slot)
            self._written.notify_all()

    def wait_written(self, key: bytes, timeout_s: float) -> bool:
        """If `key` is being written (another fetch or a put), wait until it is committed or
        aborted (at most `timeout_s`); True if it was being written."""
        deadline = time.monotonic() + timeout_s
        with self._written:
            e = self._entries.get(key)
            if e is None or e.ready:
                return False
            while e is not None and not e.ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._written.wait(left)
                e = self._entries.get(key)
            return True

    # -- reads ------------------------------------------------------------------------------
    def acquire(self, keys: list[bytes]) -> list[int]:
        """Pin the slots of the longest locally held prefix of `keys` (promoting disk hits)."""
        now = time.monotonic()
        out: list[int] = []
        with self.lock:
            self._expire(now)
            for key in keys:
                e = self._entries.get(key)
                if e is not None and e.ready:
                    self.metrics.inc("hits", "host")
                    self._touch(key)
                    if e.prefetched:
                        e.prefetched = False
                        self.metrics.inc("prefetch_hits")
                elif e is None and self.disk is not None and key in self.disk:
                    self.metrics.inc("misses", "host")
                    e = self._promote(key)
                    if e is None:
                        self.metrics.inc("misses", "disk")
                        break
                    self.metrics.inc("hits", "disk")
                else:
                    self.metrics.inc("misses", "host")
                    if self.disk is not None:
                        self.metrics.inc("misses", "disk")
                    break
                e.pins.append(now + self.pin_timeout_s)
                out.append(e.slot)
        return out

    def _touch(self, key: bytes) -> None:
        """A ready arena page was used: the most recent of its order (a demoted or expired
        page used again is an ordinary page again)."""
        if key in self._kept:
            self._kept.move_to_end(key)
        else:
            self._lru.move_to_end(key)
            self._entries[key].reason = CAPACITY

    def _promote(self, key: bytes) -> Entry | None:
        assert self.disk is not None  # callers promote only keys the disk tier holds
        slot = self._take_slot()
        if slot is None:
            return None
        before = self.disk.num_corrupt
        if not self.disk.read_into(key, self.arena.slot(slot), self.fingerprint):
            self._free.append(slot)
            if self.disk.num_corrupt > before:
                self.metrics.inc("corrupt_pages", "disk")
                if key not in self._entries:
                    self.on_gone([key])
            return None
        self.metrics.inc("bytes", "disk", "promote", value=self.page_bytes)
        e = self._entries[key] = Entry(slot, True)
        self._slot_key[slot] = key
        self._index(key)
        return e

    def release(self, slots: list[int]) -> None:
        """Unpin slots returned by `acquire` (one pin per listed slot)."""
        with self.lock:
            for slot in slots:
                e = self._entries.get(self._slot_key.get(slot, b""))
                if e is not None and e.slot == slot and e.pins:
                    e.pins.pop(0)

    def demote(self, keys: list[bytes]) -> int:
        """Move the arena pages among `keys` to the front of the LRU (evicted first, to the
        disk tier where there is one); returns how many were there."""
        with self.lock:
            n = 0
            for key in reversed(keys):  # the first key ends up first
                if key in self._lru:
                    self._lru.move_to_end(key, last=False)
                    self._entries[key].reason = DEMOTED
                    n += 1
            return n

    def retain(self, session: str, keys: list[bytes], ttl_s: float) -> int:
        """Keep the pages among `keys` this node holds for `session` until `ttl_s` from now (a
        later call only extends it); returns how many it holds."""
        with self.lock:
            held = [k for k in keys if self._holds(k)]
            if not held:
                return 0
            self._keep(self.retention.retain(session, held, ttl_s, time.time()))
            return len(held)

    def _keep(self, keys: list[bytes]) -> None:
        """Arena pages a session now holds leave the plain order for the kept one."""
        for key in keys:
            if key in self._lru:
                del self._lru[key]
                self._kept[key] = None

    def _holds(self, key: bytes) -> bool:
        e = self._entries.get(key)
        return (e is not None and e.ready) or (self.disk is not None and key in self.disk)

    def prefetch_local(self, keys: list[bytes]) -> int:
        """Bring the leading `keys` held on disk into the arena ahead of a request (one page
        per lock hold: a worker's requests never wait for the whole run); returns how many
        lead the arena now."""
        now = time.monotonic()
        n = 0
        for key in keys:
            with self.lock:
                self._expire(now)
                e = self._entries.get(key)
                if e is None and self.disk is not None and key in self.disk:
                    e = self._promote(key)
                    if e is None:
                        break
                    e.prefetched = True
                    self.metrics.inc("prefetch_pages", "disk")
                elif e is None or not e.ready:
                    break
            n += 1
        return n

    def mark_prefetched(self, slots: list[int]) -> None:
        """Slots a prefetch brought from peers (pinned by the fetch): count them and unpin."""
        with self.lock:
            for slot in slots:
                e = self._entries.get(self._slot_key.get(slot, b""))
                if e is not None and e.slot == slot:
                    e.prefetched = True
            self.metrics.inc("prefetch_pages", "remote", value=len(slots))
        self.release(slots)

    def contains_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys this node holds (arena or disk), without loading them."""
        with self.lock:
            n = 0
            for key in keys:
                if not self._holds(key):
                    break
                n += 1
            return n
