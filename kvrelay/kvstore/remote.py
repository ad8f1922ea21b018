"""Remote pages: pulling a local miss from the peer node the directory names, and answering
peers' fetches. Transfers run UCX (ucxx) when both sides have it, plain TCP otherwise; every
failure is logged, counted and reported as a miss so the caller recomputes instead of hanging.

A peer that a fetch could not reach (a timeout: a cut or hopeless link; a refused connection; a
broken session) is skipped for `retry_s`: fetches and lookups treat its pages as absent, so a
partition costs the workers one transfer timeout, not one per request (and does not fill the
node's fetch threads with fetches bound to wait it out). The first fetch after `retry_s` tries
it again; one that arrives clears the mark.

Sessions are `Peer`s (`transport/peer.py`) opened through the transport registry and used
from the node's fetch pool threads (blocking calls; UCX ones wait on the process's UCX loop).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvrelay.kvstore.arena import HostArena
from kvrelay.kvstore.directory import Directory
from kvrelay.kvstore.errors import AuthError, StoreError, TransferError, TransferTimeoutError
from kvrelay.kvstore.messages import decode_fetch
from kvrelay.kvstore.metrics import StoreMetrics
from kvrelay.kvstore.store import NodeStore
from kvrelay.kvstore.transport import Transport
from kvrelay.kvstore.transport.peer import Peer, connector
from kvrelay.kvstore.transport.session import fetch_request

if TYPE_CHECKING:
    from kvrelay.kvstore.transport.ucx_local import LocalUcx

logger = logging.getLogger(__name__)


class Remote:
    """Fetches misses from peers (client side) and serves peers' fetches (server side)."""

    def __init__(
        self,
        store: NodeStore,
        arena: HostArena,
        directory: Directory,
        metrics: StoreMetrics,
        secret: bytes,
        transport: Transport | str,
        timeout_s: float,
        loop: asyncio.AbstractEventLoop | None,
        ucx_ok: bool,
        retry_s: float = 5.0,
    ):
        self.store, self.arena, self.directory, self.metrics = store, arena, directory, metrics
        self.secret, self.transport, self.timeout_s = secret, transport, timeout_s
        self.loop, self.ucx_ok = loop, ucx_ok  # the process's UCX loop when ucx_ok
        # (transport, address) -> idle sessions; a fetch takes one out while it uses it, so
        # concurrent fetches (the node's pool threads) never share a session.
        self._peers: dict[tuple[Transport, str], list[Peer]] = {}
        self._peers_lock = threading.Lock()
        # LocalUcx when this node runs UCX (same-host worker addresses)
        self.local: LocalUcx | None = None
        self.host_id: str | None = None
        self.same_host = True
        self._tls = threading.local()  # the current fetch's deadline, per pool thread
        self.retry_s = retry_s
        self._unreachable: dict[str, float] = {}  # node id -> when a fetch may try it again
        self.num_in_flight = 0  # fetches under way (`stats`: remote_fetches/in_flight)

    def _take(self, kind: Transport, address: str) -> Peer | None:
        with self._peers_lock:
            idle = self._peers.get((kind, address))
            return idle.pop() if idle else None

    def _give(self, kind: Transport, address: str, peer: Peer) -> None:
        with self._peers_lock:
            self._peers.setdefault((kind, address), []).append(peer)

    def reachable(self, node_id: str) -> bool:
        """False while `node_id` is skipped after a failed fetch (for `retry_s`)."""
        until = self._unreachable.get(node_id)
        return until is None or time.monotonic() >= until

    def _failed(self, node_id: str, exc: BaseException) -> None:
        if self.retry_s <= 0:
            return
        first = node_id not in self._unreachable
        self._unreachable[node_id] = time.monotonic() + self.retry_s
        if first:
            logger.warning(
                "store node %s unreachable (%s); fetches skip it for %.1fs at a time until one "
                "gets through",
                node_id,
                exc,
                self.retry_s,
            )

    def _reached(self, node_id: str) -> None:
        if self._unreachable.pop(node_id, None) is not None:
            logger.warning("store node %s is reachable again", node_id)

    # -- server side (runs in the node's asyncio thread) -----------------------------------
    def serve(self, req: dict) -> tuple[dict, list[memoryview], Callable[[], None]]:
        try:
            keys = decode_fetch(req).check(self.store.fingerprint, self.store.page_bytes)
        except StoreError as exc:
            return {"ok": False, "error": str(exc)}, [], lambda: None
        slots = self.store.acquire(keys)
        self.metrics.inc("bytes", "remote", "serve", value=len(slots) * self.store.page_bytes)
        return (
            {"ok": True, "found": len(slots)},
            [self.arena.slot(s) for s in slots],
            lambda: self.store.release(slots),
        )

    # -- client side (runs on the node's fetch pool threads) --------------------------------
    def locate_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys some live peer holds, per the directory."""
        n = 0
        for nodes in self.directory.locate(keys):
            if not any(self.reachable(node_id) for node_id in nodes):
                for node_id in nodes:  # held, but only where we cannot fetch it now
                    self.metrics.inc("transfer_skips", node_id)
                break
            n += 1
        return n

    def fetch(self, keys: list[bytes]) -> list[int]:
        """Pull the longest possible prefix of `keys` from peers into pinned arena slots."""
        try:
            locs = self.directory.locate(keys)
        except Exception as exc:  # noqa: BLE001 - Redis down: a miss, not an error
            logger.warning("page directory lookup failed: %s", exc)
            return []
        pinned: list[int] = []
        with self._peers_lock:
            self.num_in_flight += 1
        try:
            i = self._fetch_prefix(keys, locs, pinned)
        except Exception:  # noqa: BLE001 - keep what arrived; the caller recomputes the rest
            logger.exception("remote fetch failed unexpectedly")
            return pinned
        finally:
            with self._peers_lock:
                self.num_in_flight -= 1
        if i < len(keys):
            self.metrics.inc("misses", "remote")
        return pinned

    def _fetch_prefix(self, keys: list[bytes], locs: list[list[str]], pinned: list[int]) -> int:
        i = 0
        # One bound for the whole fetch, however many peers it tries: the worker is waiting.
        self._tls.deadline = time.monotonic() + self.timeout_s
        while i < len(keys) and locs[i]:
            got = wanted = 0
            for node_id in locs[i]:
                if self._left() <= 0.05:
                    break
                if not self.reachable(node_id):
                    self.metrics.inc("transfer_skips", node_id)
                    continue
                j = i
                while j < len(keys) and node_id in locs[j]:
                    j += 1
                wanted = j - i
                got = self._fetch_from(node_id, keys[i:j], pinned)
                if got:
                    break
            i += got
            # a failure, a short answer, no peer tried (all skipped, or out of time): stop at
            # the first missing page (without `not got` an untried page would loop forever)
            if not got or got < wanted:
                break
        return i

    def _left(self) -> float:
        """Seconds left of the current fetch's time bound."""
        return self._tls.deadline - time.monotonic()

    def _same_host(self, info: dict[str, str]) -> bool:
        return (
            self.same_host
            and self.local is not None
            and bool(info.get("ucx_addr"))
            and info.get("host_id") == self.host_id
        )

    def _transfer(
        self, kind: Transport, address: str, request: dict, dsts: list[memoryview]
    ) -> int:
        """One fetch over a cached session; a stale session is replaced once (not on timeout)."""
        connect = connector(kind)
        for attempt in (0, 1):
            peer = self._take(kind, address)
            reused = peer is not None
            try:
                if peer is None:
                    peer = connect(address, self.secret, max(self._left(), 0.05))
                found = peer.fetch(request, dsts, max(self._left(), 0.05))
            except TransferError as exc:
                if peer is not None:
                    peer.close()
                if attempt or not reused or isinstance(exc, TransferTimeoutError | AuthError):
                    raise
                logger.info("session to %s broke (%s); reconnecting", address, exc)
                continue
            except BaseException:
                if peer is not None:
                    peer.close()
                raise
            self._give(kind, address, peer)
            return found
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close cached sessions (from any thread: closing a session never blocks)."""
        with self._peers_lock:
            peers = [peer for idle in self._peers.values() for peer in idle]
            self._peers.clear()
        for peer in peers:
            peer.close()

    def _fetch_from(self, node_id: str, keys: list[bytes], pinned: list[int]) -> int:
        info = self.directory.node_info(node_id)
        if info is None:
            return 0
        slots = self.store.reserve(keys)
        n = next((k for k, s in enumerate(slots) if s < 0), len(slots))
        self.store.abort(keys[n:], slots[n:])
        keys, slots = keys[:n], slots[:n]
        if not keys:
            return 0
        use_ucx = (
            self.ucx_ok
            and info.get(Transport.UCX)
            and self.transport in (Transport.AUTO, Transport.UCX)
        )
        kind = Transport.UCX if use_ucx else Transport.TCP
        request = fetch_request(keys, self.store.fingerprint, self.store.page_bytes)
        dsts = [self.arena.slot(s) for s in slots]
        found = 0
        via: Transport = kind
        try:
            if self.transport == Transport.UCX and not use_ucx:
                raise TransferError(f"peer {node_id} has no UCX listener (or ucxx is missing)")
            if use_ucx and self._same_host(info):
                via = Transport.UCX_LOCAL
                left = self._left()
                # _same_host: self.local is set; use_ucx: ucx_ok, so the node has a UCX loop
                assert self.local is not None and self.loop is not None
                fut = asyncio.run_coroutine_threadsafe(
                    self.local.fetch(info["ucx_addr"], request, dsts, left), self.loop
                )
                found = fut.result(left + 1)
            else:
                found = self._transfer(kind, info[kind], request, dsts)
        except (StoreError, KeyError, ValueError, TimeoutError) as exc:
            logger.warning(
                "fetch of %d pages from store node %s failed: %s", len(keys), node_id, exc
            )
            self.metrics.inc("transfer_failures", kind)
            self._failed(node_id, exc)
            self.store.abort(keys, slots)
            return 0
        self._reached(node_id)
        errors = self.store.commit(
            keys[:found], slots[:found], pin=True, verify=True, kind=f"fetch_{via}"
        )
        self.store.abort(keys[found:], slots[found:])
        good = next((k for k, e in enumerate(errors) if e is not None), found)
        if good < found:
            logger.warning("page from %s failed verification: %s", node_id, errors[good])
            self.metrics.inc("corrupt_pages", "remote")
            self.store.release(
                [s for s, e in zip(slots[good:found], errors[good:], strict=True) if e is None]
            )
            found = good
        if found < len(keys):  # the directory was stale for this page
            self.directory.remove([keys[found]], node_id)
        self.metrics.inc("hits", "remote", value=found)
        self.metrics.inc("bytes", "remote", f"fetch_{via}", value=found * self.store.page_bytes)
        pinned.extend(slots[:found])
        return found
