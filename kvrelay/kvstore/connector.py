"""StoreConnector: the engine's KVConnector over a StoreClient.

A pool block `kv_pool[b]` ([num_layers, 2, page_size, kv_heads, head_dim]) is byte-identical to a
page payload, so load and save are one copy each between the pool and a shared arena slot (an
asynchronous DMA on CUDA once the arena is registered as pinned memory). On CUDA the copies run
on a side stream of their own: a load (on the engine's loader thread) overlaps the forward
passes on the compute stream, and waits for its own copies only. Store failures are
logged and reported as misses: the engine recomputes instead of failing the request. That
includes a node killed or restarting mid-call (zmq errors, a vanished arena file, a reply cut
short), not only the errors the node reports: churn must never fail a request. A node that is
down (`liveness`: its socket closed, not a slow reply) fails a call at once, and is logged
once when it goes and once when it is back, not at every call.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from kvrelay.kvstore.client import StoreClient
from kvrelay.kvstore.errors import StoreError, StoreNodeDownError

if TYPE_CHECKING:
    import torch

    from kvrelay.kvstore.arena import HostArena
    from kvrelay.kvstore.liveness import NodeLiveness

logger = logging.getLogger(__name__)


def _failed(what: str, exc: Exception) -> None:
    """Log a failed call: a warning, or debug for a node that is down (logged once, there)."""
    level = logging.DEBUG if isinstance(exc, StoreNodeDownError) else logging.WARNING
    logger.log(level, "%s failed, recomputing: %r", what, exc)


def _on(stream):
    """`torch.cuda.stream(stream)`, or no context for None (CPU pools)."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


class StoreConnector:
    """lookup / load / save pages of one model between a KV pool and the local store node."""

    def __init__(self, client: StoreClient):
        self.client = client
        self._registered: HostArena | None = None  # the arena mapping registered with CUDA
        self._stream: torch.cuda.Stream | None = None  # the CUDA side stream of the copies

    @property
    def liveness(self) -> NodeLiveness:
        """Whether the node is up, from its socket (the engine skips the store while down)."""
        return self.client.liveness

    def _side_stream(self, kv_pool) -> torch.cuda.Stream:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(kv_pool.device)
        return self._stream

    def _check(self, kv_pool) -> bool:
        spec = self.client.spec
        if spec is None:
            raise StoreError("StoreConnector needs a StoreClient with a PageSpec")
        dtype = str(kv_pool.dtype).removeprefix("torch.")
        if tuple(kv_pool.shape[1:]) != spec.shape or dtype != spec.dtype:
            raise StoreError(
                f"KV pool blocks are {tuple(kv_pool.shape[1:])} {dtype}, "
                f"store pages are {spec.shape} {spec.dtype}"
            )
        if not kv_pool.is_contiguous():
            raise StoreError("the KV pool must be contiguous")
        cuda = kv_pool.is_cuda
        if cuda:
            if self.client.arena is None:
                self.client.connect()
            arena = self.client.arena
            assert arena is not None  # connect() maps it
            if self._registered is not arena:  # a new mapping after a node restart
                arena.register_cuda()
                self._registered = arena
        return cuda

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading keys the store can provide."""
        try:
            return self.client.lookup(keys)
        except Exception as exc:  # any store failure is a miss (see the module docstring)
            _failed("store lookup", exc)
            return 0

    def load(self, keys: list[bytes], block_ids: list[int], kv_pool) -> int:
        """Copy the leading available, verified pages into `block_ids`; returns how many."""
        import torch

        if len(block_ids) < len(keys):
            raise StoreError(f"load: {len(keys)} keys but only {len(block_ids)} blocks")
        cuda = self._check(kv_pool)
        try:
            with self.client.pinned(list(keys)) as views:
                shape = kv_pool.shape[1:]
                side = self._side_stream(kv_pool) if cuda else None
                with _on(side):
                    for view, block in zip(views, block_ids, strict=False):
                        src = torch.frombuffer(view, dtype=kv_pool.dtype).view(shape)
                        kv_pool[block].copy_(src, non_blocking=cuda)
                if side is not None:
                    side.synchronize()  # before unpinning
                return len(views)
        except Exception as exc:
            _failed("store load", exc)
            return 0

    def demote(self, keys: list[bytes]) -> None:
        """Tell the node no window reads these pages any more (evicted first); one-way."""
        try:
            self.client.demote(list(keys))
        except Exception as exc:  # a hint: losing it costs nothing
            logger.debug("store demote of %d pages failed: %r", len(keys), exc)

    def retain(self, keys: list[bytes], session: str, ttl_s: float) -> None:
        """Keep these pages for `session` until `ttl_s` from now; one-way."""
        try:
            self.client.retain(list(keys), session, ttl_s)
        except Exception as exc:  # a hint: losing it costs only a later eviction
            logger.debug("store retain of %d pages failed: %r", len(keys), exc)

    def save(self, keys: list[bytes], block_ids: list[int], kv_pool) -> None:
        """Write the blocks as pages (existing keys are skipped); copied before returning."""
        import torch

        if len(block_ids) != len(keys):
            raise StoreError(f"save: {len(keys)} keys but {len(block_ids)} blocks")
        cuda = self._check(kv_pool)

        def fill(items: list[tuple[int, memoryview]]) -> None:
            shape = kv_pool.shape[1:]
            side = None
            if cuda:  # after the compute that wrote the blocks
                side = self._side_stream(kv_pool)
                side.wait_stream(torch.cuda.current_stream(kv_pool.device))
            with _on(side):
                for i, dst in items:
                    out = torch.frombuffer(dst, dtype=kv_pool.dtype).view(shape)
                    out.copy_(kv_pool[block_ids[i]], non_blocking=cuda)
            if side is not None:
                side.synchronize()  # before checksums

        try:
            self.client.put_with(list(keys), fill)
        except Exception as exc:  # a page not saved is recomputed by whoever needs it
            _failed(f"store save of {len(keys)} pages", exc)
