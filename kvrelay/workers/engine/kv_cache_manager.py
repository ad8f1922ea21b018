"""Blocks of each sequence: prefix hits (device cache, then store), slot allocation, saving.

The scheduler decides *how many* tokens each sequence computes; this class finds and holds the
blocks for them, so the scheduler never touches block ids or the KV pool.

Store hits are fetched beside the compute loop (`KVLoader`): `ready(seq)` starts a lookup, then a
load into blocks reserved for it, and says True once the prefix is settled (loaded, absent,
failed or timed out: then the rest is recomputed); until then the scheduler leaves that request
waiting and keeps stepping the others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvrelay.core.page_keys import page_key
from kvrelay.workers.engine.block_pool import BlockPool
from kvrelay.workers.engine.kv_connector import KVConnector
from kvrelay.workers.engine.kv_loader import Fetch, KVLoader
from kvrelay.workers.engine.sequence import Sequence

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
        self._kv_pool = kv_pool
        self.num_store_errors = 0
        self.fetch_timeout_s = 5.0  # a store fetch taking longer is abandoned: recompute
        self.admit_wait_s = 0.005  # per step, for fetches started in it (a local fetch lands)
        self._wait_until = 0.0
        self._abandoned: list[Fetch] = []  # loads given up on; blocks held until done
        self._pending: set[Fetch] = set()  # fetches of waiting sequences
        self.loader: KVLoader | None = None
        self.connector: KVConnector | None = None
        self.set_connector(connector, save_to_store=save_to_store)

    def set_connector(
        self,
        connector: KVConnector | None,
        load_connectors: list[KVConnector] | None = None,
        save_to_store: bool = True,
    ) -> None:
        """Saves go through `connector` (compute thread), lookups and loads through
        `load_connectors` (default: the same one), one loader thread each."""
        if self.loader is not None:
            self.loader.close()
        self.connector = connector
        self.save_to_store = save_to_store and connector is not None
        loads = load_connectors or ([connector] if connector is not None else [])
        if loads:
            assert self._kv_pool is not None, "a store connector needs the KV pool"
            self.loader = KVLoader(list(loads), self._kv_pool)
        else:
            self.loader = None

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

    def _prefix_keys(self, seq: Sequence) -> list[bytes]:
        if seq.wants_prompt_logprobs:  # every prompt position is computed (as vLLM does)
            return []
        # At least one token must be computed to get logits for the next one.
        return self._keys(seq, (seq.num_tokens - 1) // self.page_size)

    def start_admission(self) -> None:
        """A new schedule: release abandoned fetches the loader is done with; reset the wait."""
        self._wait_until = time.monotonic() + self.admit_wait_s
        if self._abandoned:
            for f in [f for f in self._abandoned if f.done]:
                self._abandoned.remove(f)
                self.pool.release(f.block_ids)

    def has_pending_fetches(self) -> bool:
        return bool(self._pending)

    def wait_fetches(self, timeout: float) -> None:
        """Block up to `timeout` s for the pending fetches (only when nothing is computing)."""
        busy = [f for f in self._pending if not f.done]
        if self.loader is not None and busy:
            self.loader.wait(busy, timeout)

    def ready(self, seq: Sequence) -> bool:
        """Whether the store part of `seq`'s prefix is settled, so it can be admitted now;
        starts or advances its fetch (lookup, then a load into reserved blocks)."""
        while True:
            if self.loader is None or seq.store_checked:
                return True
            f: Fetch | None = seq.fetch
            if f is None:
                keys = self._prefix_keys(seq)
                rest = keys[len(self.pool.lookup(keys)) :]
                if not rest:
                    seq.store_checked = True
                    return True
                f = seq.fetch = self._submit(Fetch(rest))
            if not f.done:
                left = self._wait_until - time.monotonic()
                if f.submitted >= self._wait_until - self.admit_wait_s and left > 0:
                    self.loader.wait([f], left)  # started in this schedule: a local one lands
                if not f.done:
                    if time.monotonic() - f.started > self.fetch_timeout_s:
                        logger.warning(
                            "store fetch for request %s took over %.1fs; recomputing",
                            seq.request_id,
                            self.fetch_timeout_s,
                        )
                        self._abandon(seq)
                        return True
                    return False
            self._pending.discard(f)
            if f.failed:
                self.num_store_errors += 1
            if f.is_load:
                self._landed(seq, f)
                return True
            n = min(f.result, self.pool.num_free_blocks)
            if n <= 0:
                seq.fetch, seq.store_checked = None, True
                return True
            seq.fetch = self._submit(Fetch(f.keys[:n], self.pool.allocate(n), started=f.started))

    def _submit(self, f: Fetch) -> Fetch:
        assert self.loader is not None  # only `ready` submits, once it saw a loader
        self._pending.add(f)
        return self.loader.submit(f)

    def _landed(self, seq: Sequence, f: Fetch) -> None:
        """A load finished: key the verified pages; they stay held until `match_prefix`."""
        n = f.result
        self.pool.release(f.block_ids[n:])
        for key, block_id in zip(f.keys[:n], f.block_ids[:n], strict=True):
            self.pool.cache_block(block_id, key)
        seq.loaded_blocks = f.block_ids[:n]
        seq.fetch, seq.store_checked = None, True

    def _abandon(self, seq: Sequence) -> None:
        """Give up on `seq`'s fetch; its blocks go back once the loader is done with them."""
        f = seq.fetch
        seq.fetch, seq.store_checked = None, True
        if f is None:
            return
        self._pending.discard(f)
        if f.is_load:
            self._abandoned.append(f)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest known prefix; returns the tokens now computed.

        Call once `ready(seq)`: pages it loaded from the store are in the device cache then."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        keys = self._prefix_keys(seq)
        hits = self.pool.lookup(keys)
        self.pool.acquire(hits)
        loaded = set(seq.loaded_blocks)
        self.pool.release(seq.loaded_blocks)  # hits now hold them; the rest stay cached
        seq.loaded_blocks = []
        seq.block_table = list(hits)
        num_store = sum(b in loaded for b in hits)
        num_device = len(hits) - num_store
        n_blocks = len(hits)
        seq.num_computed_tokens = n_blocks * self.page_size
        seq.num_registered_blocks = n_blocks
        seq.num_saved_blocks = n_blocks  # hits came from the store or were saved when computed
        if not seq.admitted:
            seq.num_device_cached_tokens = num_device * self.page_size
            seq.num_store_cached_tokens = num_store * self.page_size
            seq.num_cached_tokens = seq.num_computed_tokens
        return seq.num_computed_tokens

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
        self._abandon(seq)
        self.pool.release(seq.loaded_blocks)
        seq.loaded_blocks = []
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.spec.draft_computed = 0  # a draft model's K/V lives in the same block ids

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
        # save_to_store needs a connector, and a connector the KV pool (set_connector)
        assert self.connector is not None and self._kv_pool is not None
        try:
            self.connector.save(new_keys, new_blocks, self._kv_pool())
        except Exception:  # the store is a cache: a failed save loses nothing
            logger.exception("kv connector save failed for request %s", seq.request_id)
            self.num_store_errors += 1
