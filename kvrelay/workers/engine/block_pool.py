"""KV block pool: reference-counted blocks, a prefix cache keyed by page keys, LRU eviction.

A block holds `page_size` tokens of K/V. A *full* block may carry a key (the chained
`kvrelay.core.page_keys.page_key` of its tokens), which makes it findable by later requests with
the same prefix. Blocks whose reference count drops to zero go to the free queue but keep their
key and contents until they are handed out again, so a freed prefix can still be hit.

Free-queue order (the eviction order): blocks without a key are handed out first (they hold
nothing reusable), then keyed blocks, least recently freed first. When a sequence is freed its
blocks are queued tail first, so a prefix's last blocks are evicted before its first ones
(a partially evicted prefix still gives hits for its head).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.core.errors import KvrelayError

logger = logging.getLogger(__name__)


class NoFreeBlocksError(KvrelayError, RuntimeError):
    """Asked for more blocks than are free (callers check `num_free_blocks` first)."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None


class BlockPool:
    """Owns block ids `0..num_blocks-1`, their reference counts and the key -> block map."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order; values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order they would be handed out (for tests and debugging)."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each), evicting their old keys."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                if self._cached.get(block.key) == block_id:
                    del self._cached[block.key]
                block.key = None
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block_id)
        return out

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Block ids holding the leading `keys` (stops at the first miss); refs unchanged."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in keys:
            block_id = self._cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cached(self, key: bytes) -> int | None:
        """The block holding `key`, or None (refs unchanged)."""
        if not self.enable_prefix_caching:
            return None
        return self._cached.get(key)

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (a cache hit); free ones leave the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.key is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, key: bytes) -> bool:
        """Register a full, computed block under `key`; False if another block already has it."""
        if not self.enable_prefix_caching:
            return False
        block = self.blocks[block_id]
        if block.key == key:
            return True
        existing = self._cached.get(key)
        if existing is not None and existing != block_id:
            return False
        if block.key is not None and self._cached.get(block.key) == block_id:
            del self._cached[block.key]
        block.key = key
        self._cached[key] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every key held by a free block; returns how many were dropped."""
        dropped = 0
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.key is not None:
                del self._cached[block.key]
                block.key = None
                dropped += 1
        return dropped
