"""Store lookups and loads on a thread of their own, so admission never blocks the compute loop.

The compute thread submits a `Fetch` (lookup: how many of these keys does the store hold; load:
copy them into blocks it reserved) and polls `done`; the loader thread only calls the connector
and writes into the reserved blocks, which no running sequence references. A fetch that takes
too long, or whose store node is lost meanwhile, is abandoned by the compute thread: its request
is recomputed, and its blocks are released once the loader is finished with them.

Each fetch's time in the connector is recorded per phase (`FetchSpans`: lookup, load), the
worker's `kvrelay:kv_store_fetch_seconds`: what a prefetch hides shows there as shorter loads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


SPAN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(slots=True)
class FetchSpans:
    """Durations of one fetch phase: a histogram over SPAN_BUCKETS, their sum and the pages."""

    buckets: list[int] = field(default_factory=lambda: [0] * len(SPAN_BUCKETS))
    count: int = 0
    seconds: float = 0.0
    pages: int = 0

    def add(self, seconds: float, pages: int) -> None:
        for i, bound in enumerate(SPAN_BUCKETS):
            if seconds <= bound:
                self.buckets[i] += 1
                break
        self.count += 1
        self.seconds += seconds
        self.pages += pages


@dataclass(slots=True, eq=False)
class Fetch:
    """One store request of one sequence (compute thread sets it up, loader fills the result)."""

    keys: list[bytes]
    block_ids: list[int] = field(default_factory=list)  # empty: a lookup; else a load into them
    blocks: list[int] = field(default_factory=list)  # each key's token block (KV groups)
    round: int = 0  # lookups before this one for the same admission (a shrinking prefix)
    started: float = field(default_factory=time.monotonic)  # the first phase (timeout)
    submitted: float = field(default_factory=time.monotonic)  # this phase
    losses: int = 0  # the store node's losses (StoreLiveness) when this phase was submitted
    result: int = 0  # lookup: keys available; load: leading pages copied and verified
    done: bool = False
    failed: bool = False

    @property
    def is_load(self) -> bool:
        return bool(self.block_ids)


class KVLoader:
    """Daemon threads, one per connector (each its own store socket), taking fetches in order;
    with several, one fetch stuck on a slow peer does not hold up the others."""

    def __init__(self, connectors: list[Any], kv_pool: Callable[[], Any]):
        self.connectors = connectors
        self._kv_pool = kv_pool
        self._jobs: queue.SimpleQueue[Fetch | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self.spans = {"lookup": FetchSpans(), "load": FetchSpans()}  # updated under _cond

    def submit(self, fetch: Fetch) -> Fetch:
        if not self._threads:
            for i, conn in enumerate(self.connectors):
                t = threading.Thread(
                    target=self._run, args=(conn,), name=f"kv-loader-{i}", daemon=True
                )
                t.start()
                self._threads.append(t)
        self._jobs.put(fetch)
        return fetch

    def wait(self, fetches: list[Fetch], timeout: float) -> bool:
        """Wait up to `timeout` s until one of `fetches` is done (the compute thread has no
        batch, or a local fetch is about to land); True when one is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(f.done for f in fetches):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def _run(self, connector: Any) -> None:
        while True:
            fetch = self._jobs.get()
            if fetch is None:
                return
            start = time.monotonic()
            try:
                if fetch.is_load:
                    n = len(fetch.block_ids)
                    got = connector.load(fetch.keys[:n], fetch.block_ids, self._kv_pool())
                    fetch.result = max(0, min(int(got), n))
                else:
                    fetch.result = max(0, min(int(connector.lookup(fetch.keys)), len(fetch.keys)))
            except Exception:  # a store failure only costs a recompute
                logger.exception(
                    "kv store %s failed; recomputing", "load" if fetch.is_load else "lookup"
                )
                fetch.failed, fetch.result = True, 0
            spent = time.monotonic() - start
            with self._cond:
                phase = "load" if fetch.is_load else "lookup"
                self.spans[phase].add(spent, fetch.result if fetch.is_load else 0)
                fetch.done = True
                self._cond.notify_all()
