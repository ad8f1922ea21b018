"""Blocks of each sequence: prefix hits (device cache, then store), slot allocation, saving.

The scheduler decides *how many* tokens each sequence computes; this class finds and holds the
blocks for them, so the scheduler never touches block ids or the KV pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvrelay.kvstore.keys import page_key
from kvrelay.workers.block_pool import BlockPool
from kvrelay.workers.kv_connector import KVConnector
from kvrelay.workers.sequence import Sequence

logger = logging.getLogger(__name__)


class KVCacheManager:
    """Owns the mapping sequence -> blocks over one BlockPool (and optionally a KVConnector)."""

    def __init__(
        self,
        pool: BlockPool,
        page_size: int,
        fingerprint: str,
        connector: KVConnector | None = None,
        kv_pool: Callable[[], torch.Tensor] | None = None,
        save_to_store: bool = True,
    ):
        self.pool = pool
        self.page_size = page_size
        self.fingerprint = fingerprint
        self.connector = connector
        self._kv_pool = kv_pool
        self.save_to_store = save_to_store and connector is not None
        self.num_store_errors = 0

    def _keys(self, seq: Sequence, num_full: int) -> list[bytes]:
        """Chained keys of the first `num_full` blocks of `seq` (computed once, appended)."""
        keys = seq.block_keys
        P = self.page_size
        while len(keys) < num_full:
            i = len(keys)
            parent = keys[-1] if keys else None
            keys.append(
                page_key(
                    parent, seq.token_ids[i * P : (i + 1) * P], self.fingerprint, seq.cache_salt
                )
            )
        return keys[:num_full]

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest known prefix; returns the tokens now computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        # At least one token must be computed to get logits for the next one.
        max_blocks = (seq.num_tokens - 1) // self.page_size
        keys = self._keys(seq, max_blocks)
        hits = self.pool.lookup(keys)
        self.pool.acquire(hits)
        seq.block_table = list(hits)
        num_device = len(hits)
        rest = keys[num_device:]
        loaded = self._load(rest) if rest and self.connector is not None else []
        seq.block_table.extend(loaded)
        num_store = len(loaded)
        n_blocks = num_device + num_store
        seq.num_computed_tokens = n_blocks * self.page_size
        seq.num_registered_blocks = n_blocks
        seq.num_saved_blocks = n_blocks  # hits came from the store or were saved when computed
        if not seq.admitted:
            seq.num_device_cached_tokens = num_device * self.page_size
            seq.num_store_cached_tokens = num_store * self.page_size
            seq.num_cached_tokens = seq.num_computed_tokens
        return seq.num_computed_tokens

    def _load(self, keys: list[bytes]) -> list[int]:
        """Load the leading available `keys` from the store into fresh blocks."""
        try:
            n = self.connector.lookup(keys)
        except Exception:  # a store failure only costs a recompute
            logger.exception("kv connector lookup failed; recomputing")
            self.num_store_errors += 1
            return []
        n = min(n, self.pool.num_free_blocks)
        if n <= 0:
            return []
        block_ids = self.pool.allocate(n)
        try:
            loaded = self.connector.load(keys[:n], block_ids, self._kv_pool())
        except Exception:
            logger.exception("kv connector load failed; recomputing")
            self.num_store_errors += 1
            loaded = 0
        loaded = max(0, min(int(loaded), n))
        self.pool.release(block_ids[loaded:])
        for key, block_id in zip(keys[:loaded], block_ids[:loaded], strict=True):
            self.pool.cache_block(block_id, key)
        return block_ids[:loaded]

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.page_size) - len(seq.block_table))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; False (nothing changed) if no blocks."""
        need = self.num_blocks_needed(seq, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return False
        if need:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks; its full keyed blocks stay findable until evicted."""
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def commit(self, seq: Sequence) -> None:
        """After a step: key newly full computed blocks, register them and save each page once."""
        num_full = seq.num_computed_tokens // self.page_size
        start = seq.num_registered_blocks
        if num_full <= start:
            return
        keys = self._keys(seq, num_full)
        new_keys, new_blocks = [], []
        for i in range(start, num_full):
            block_id = seq.block_table[i]
            # False with caching on: another block already holds this page, and it was saved
            # (or loaded from the store) when it was cached, so it is not saved again.
            if self.pool.cache_block(block_id, keys[i]) or not self.pool.enable_prefix_caching:
                new_keys.append(keys[i])
                new_blocks.append(block_id)
        seq.num_registered_blocks = seq.num_saved_blocks = num_full
        if not self.save_to_store or not new_keys:
            return
        try:
            self.connector.save(new_keys, new_blocks, self._kv_pool())
        except Exception:  # the store is a cache: a failed save loses nothing
            logger.exception("kv connector save failed for request %s", seq.request_id)
            self.num_store_errors += 1
