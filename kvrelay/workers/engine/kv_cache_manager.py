"""Blocks of each sequence: prefix hits (device cache, then store), slot allocation, saving.

The scheduler decides *how many* tokens each sequence computes; this class finds and holds the
blocks for them, so the scheduler never touches block ids or the KV pool.

Store hits are fetched beside the compute loop (`KVLoader`): `ready(seq)` starts a lookup, then a
load into blocks reserved for it, and says True once the prefix is settled (loaded, absent,
failed or timed out: then the rest is recomputed); until then the scheduler leaves that request
waiting and keeps stepping the others. Whether the store node is there at all comes from the
connectors' `liveness` (its socket), not from `fetch_timeout_s`: a fetch whose node is lost is
given up at once, and while the node is down no admission asks it and no page is saved to it.

KV groups (core.kv_layout): each group of layers has its own block table per sequence, all
drawing from the one pool. A full group's table holds every page; a local (sliding-window)
group's releases the blocks its window has left behind (`RELEASED` entries), so a sequence's
blocks in local groups are bounded by the window plus one step's tokens. A prefix of L blocks
is a hit when every full group holds blocks 0..L-1 and every local group the blocks its window
reads from position L*P on; a local page is saved to the store only while a resume at the
sequence's last full block still reads it. With one group (every full-attention model) all of
this is what it was before groups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvrelay.core.kv_layout import KVGroup, KVLayout, group_key
from kvrelay.core.page_keys import lora_fingerprint, page_key
from kvrelay.workers.engine.block_pool import BlockPool
from kvrelay.workers.engine.kv_connector import KVConnector, StoreLiveness
from kvrelay.workers.engine.kv_loader import Fetch, KVLoader
from kvrelay.workers.engine.sequence import Sequence

logger = logging.getLogger(__name__)

RELEASED = -1  # a local group's table entry for a block its window has left behind
MAX_STORE_ROUNDS = 8  # store lookups per admission while the candidate prefix keeps shrinking


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
        layout: KVLayout | None = None,
    ):
        self.pool = pool
        self.layout = layout or KVLayout.from_windows(1)
        self.groups: tuple[KVGroup, ...] = self.layout.groups
        # blocks the sequences' tables hold, per group (a local group's: about its window's)
        self.held_blocks = [0] * len(self.groups)
        self.page_size = page_size
        self.fingerprint = fingerprint
        self._kv_pool = kv_pool
        self.num_store_errors = 0
        self.num_fetch_timeouts = 0  # fetches abandoned after fetch_timeout_s (a slow node)
        self.num_fetches_lost = 0  # fetches given up because their store node went away
        self.num_store_skips = 0  # admissions that did not ask the store: its node was down
        self.fetch_timeout_s = 5.0  # a store fetch taking longer is abandoned: recompute
        self._liveness: list[StoreLiveness] = []  # of the connectors' store nodes
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
        self._liveness = []
        for conn in [connector, *loads]:
            live = getattr(conn, "liveness", None)
            if live is not None and all(live is not known for known in self._liveness):
                self._liveness.append(live)
        if loads:
            assert self._kv_pool is not None, "a store connector needs the KV pool"
            self.loader = KVLoader(list(loads), self._kv_pool)
        else:
            self.loader = None

    def _keys(self, seq: Sequence, num_full: int) -> list[bytes]:
        """Chained keys of the first `num_full` blocks of `seq` (computed once, appended)."""
        keys = seq.block_keys
        P = self.page_size
        # a LoRA adapter's pages are its own (never the base model's or another adapter's)
        fingerprint = (
            self.fingerprint
            if seq.lora is None
            else lora_fingerprint(self.fingerprint, seq.lora.salt)
        )
        while len(keys) < num_full:
            i = len(keys)
            parent = keys[-1] if keys else None
            keys.append(
                page_key(parent, seq.token_ids[i * P : (i + 1) * P], fingerprint, seq.cache_salt)
            )
        return keys[:num_full]

    def store_down(self) -> bool:
        """Whether a store node of the connectors is down (not slow: gone)."""
        return any(live.down for live in self._liveness)

    def _store_losses(self) -> int:
        return sum(live.losses for live in self._liveness)

    def _lost(self, f: Fetch) -> bool:
        """Whether `f`'s store node went away since `f` was submitted (or is down now)."""
        return self.store_down() or self._store_losses() != f.losses

    def _given_up(self, seq: Sequence) -> None:
        self.num_fetches_lost += 1
        logger.debug("store node lost during request %s's fetch; recomputing", seq.request_id)

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
        starts or advances its fetch (lookups, then a load into reserved blocks)."""
        while True:
            if self.loader is None or seq.store_checked:
                return True
            f: Fetch | None = seq.fetch
            if f is None:
                if self.store_down():  # no request waits on a node that is gone
                    self.num_store_skips += 1
                    seq.store_checked = True
                    return True
                f = self._lookup(seq, len(self._prefix_keys(seq)))
                if f is None:
                    seq.store_checked = True
                    return True
                seq.fetch = f
            if not f.done:
                left = self._wait_until - time.monotonic()
                if f.submitted >= self._wait_until - self.admit_wait_s and left > 0:
                    self.loader.wait([f], left)  # started in this schedule: a local one lands
                if not f.done:
                    if self._lost(f):
                        self._given_up(seq)
                        self._abandon(seq)
                        return True
                    if time.monotonic() - f.started > self.fetch_timeout_s:
                        self.num_fetch_timeouts += 1
                        logger.warning(
                            "store fetch for request %s took over %.1fs; recomputing",
                            seq.request_id,
                            self.fetch_timeout_s,
                        )
                        self._abandon(seq)
                        return True
                    return False
            self._pending.discard(f)
            lost = self._lost(f)
            if f.failed and not lost:
                self.num_store_errors += 1
            if f.is_load:
                self._landed(seq, f)  # the pages that verified are good, whatever came after
                if lost and f.result < len(f.block_ids):
                    self._given_up(seq)
                return True
            if lost:  # nothing to load from
                self._given_up(seq)
                seq.fetch, seq.store_checked = None, True
                return True
            keys, blocks = f.keys, f.blocks
            if f.result < len(keys):  # the candidate prefix ends before its first missing page
                present = set(keys[: f.result])
                keys, blocks = self._items(seq, f.blocks[f.result])
                if not set(keys) <= present:  # a window further back: ask about its pages
                    nxt = None
                    if f.round + 1 < MAX_STORE_ROUNDS and keys:
                        nxt = self._lookup(seq, f.blocks[f.result], f.started, f.round + 1)
                    seq.fetch = nxt
                    if nxt is None:
                        seq.store_checked = True
                        return True
                    continue
            n = min(len(keys), self.pool.num_free_blocks)
            if n <= 0:
                seq.fetch, seq.store_checked = None, True
                return True
            load = Fetch(keys[:n], self.pool.allocate(n), blocks[:n], started=f.started)
            seq.fetch = self._submit(load)

    def _items(self, seq: Sequence, num_blocks: int) -> tuple[list[bytes], list[int]]:
        """The pages (group keys, each with its token block) a prefix of `num_blocks` blocks
        needs that the device cache does not hold, block by block."""
        keys = self._keys(seq, num_blocks)
        P = self.page_size
        out_keys, out_blocks = [], []
        starts = [g.first_block(num_blocks * P, P) for g in self.groups]
        for i in range(num_blocks):
            for g, first in enumerate(starts):
                if i >= first:
                    key = group_key(keys[i], g)
                    if self.pool.cached(key) is None:
                        out_keys.append(key)
                        out_blocks.append(i)
        return out_keys, out_blocks

    def _lookup(
        self, seq: Sequence, num_blocks: int, started: float | None = None, rounds: int = 0
    ) -> Fetch | None:
        """A store lookup of the pages a `num_blocks`-block prefix lacks (None: none lacks)."""
        keys, blocks = self._items(seq, num_blocks)
        if not keys:
            return None
        f = Fetch(keys, blocks=blocks, round=rounds)
        if started is not None:
            f.started = started
        return self._submit(f)

    def _submit(self, f: Fetch) -> Fetch:
        assert self.loader is not None  # only `ready` submits, once it saw a loader
        self._pending.add(f)
        f.losses = self._store_losses()
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

    def tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s block table of each KV group (group 0's is `seq.block_table`)."""
        if len(seq.group_tables) != len(self.groups) - 1:
            seq.group_tables = [[] for _ in self.groups[1:]]
        return [seq.block_table, *seq.group_tables]

    def _device_hit(self, keys: list[bytes]) -> int:
        """The longest prefix (in blocks) of `keys` every group holds in the device cache."""
        n = len(keys)
        for g, group in enumerate(self.groups):
            if not group.local:
                n = min(n, len(self.pool.lookup([group_key(k, g) for k in keys[:n]])))
        local = [(g, group) for g, group in enumerate(self.groups) if group.local]
        P = self.page_size
        while n > 0 and local:  # the window of a prefix of n blocks, in every local group
            missing = None
            for g, group in local:
                for i in range(n - 1, group.first_block(n * P, P) - 1, -1):
                    if self.pool.cached(group_key(keys[i], g)) is None:
                        missing = i if missing is None else max(missing, i)
                        break
            if missing is None:
                break
            n = missing  # a shorter prefix's window ends before the missing page
        return n

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest known prefix; returns the tokens now computed.

        Call once `ready(seq)`: pages it loaded from the store are in the device cache then."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        keys = self._prefix_keys(seq)
        n_blocks = self._device_hit(keys)
        P = self.page_size
        tables = self.tables(seq)
        loaded = set(seq.loaded_blocks)
        from_store: set[int] = set()
        for g, group in enumerate(self.groups):
            first = group.first_block(n_blocks * P, P)
            hits = [self.pool.cached(group_key(keys[i], g)) for i in range(first, n_blocks)]
            ids = [b for b in hits if b is not None]
            assert len(ids) == len(hits)  # _device_hit found each of them
            self.pool.acquire(ids)
            tables[g][:] = [RELEASED] * first + ids
            self.held_blocks[g] += len(ids)
            from_store.update(first + j for j, b in enumerate(ids) if b in loaded)
        self.pool.release(seq.loaded_blocks)  # hits now hold them; the rest stay cached
        seq.loaded_blocks = []
        num_store = len(from_store)
        num_device = n_blocks - num_store
        seq.num_computed_tokens = n_blocks * P
        seq.num_registered_blocks = n_blocks
        seq.num_saved_blocks = n_blocks  # hits came from the store or were saved when computed
        if not seq.admitted:
            seq.num_device_cached_tokens = num_device * P
            seq.num_store_cached_tokens = num_store * P
            seq.num_cached_tokens = seq.num_computed_tokens
        return seq.num_computed_tokens

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks (all groups) `num_new_tokens` more tokens take."""
        total = seq.num_computed_tokens + num_new_tokens
        return len(self.groups) * max(0, -(-total // self.page_size) - len(seq.block_table))

    def max_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks (all groups) a sequence of `num_tokens` tokens holds at once, at
        most `step_tokens` computed in one step: a local group holds its window's blocks and
        one step's."""
        P = self.page_size
        total = 0
        for group in self.groups:
            blocks = -(-num_tokens // P)
            if group.local:
                blocks = min(blocks, -(-(group.window - 1 + step_tokens) // P) + 1)
            total += blocks
        return total

    def num_held_blocks(self, seq: Sequence) -> list[int]:
        """Blocks `seq` holds in each KV group (a local group's released ones not counted)."""
        return [sum(b != RELEASED for b in t) for t in self.tables(seq)]

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; False (nothing changed) if no blocks."""
        need = self.num_blocks_needed(seq, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return False
        if need:
            per_group = need // len(self.groups)
            for g, table in enumerate(self.tables(seq)):
                table.extend(self.pool.allocate(per_group))
                self.held_blocks[g] += per_group
        return True

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks; its full keyed blocks stay findable until evicted."""
        self._abandon(seq)
        self.pool.release(seq.loaded_blocks)
        seq.loaded_blocks = []
        tables = self.tables(seq)
        for g in reversed(range(len(tables))):  # group 0's last: evicted last
            held = [b for b in tables[g] if b != RELEASED]
            self.pool.release(held)
            self.held_blocks[g] -= len(held)
        seq.block_table = []
        seq.group_tables = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.spec.draft_computed = 0  # a draft model's K/V lives in the same block ids

    def retain(self, seq: Sequence) -> None:
        """Ask the store to keep the saved pages a next turn of `seq`'s session would hit
        (every full page of each full group; a local group's in the window of the last full
        block), for the session's TTL; one-way."""
        retention = seq.retention
        retain = getattr(self.connector, "retain", None)
        num_full = min(seq.num_saved_blocks, len(seq.block_keys))
        if retention is None or retain is None or not self.save_to_store or num_full == 0:
            return
        if self.store_down():
            return
        P = self.page_size
        keys = [
            group_key(key, g)
            for g, group in enumerate(self.groups)
            for key in seq.block_keys[group.first_block(num_full * P, P) : num_full]
        ]
        try:
            retain(keys, retention.session, retention.ttl_s)
        except Exception:  # a hint to the store: losing it costs a later eviction only
            logger.debug("store retain failed for request %s", seq.request_id)

    def commit(self, seq: Sequence) -> None:
        """After a step: key newly full computed blocks, register them and save each page once
        (a local group's only while a resume at the last full block reads it); release the
        blocks local windows have left behind."""
        num_full = seq.num_computed_tokens // self.page_size
        start = seq.num_registered_blocks
        tables = self.tables(seq)
        if num_full > start:
            self._register(seq, tables, start, num_full)
        if self.layout.has_local:
            self._release_behind_windows(seq, tables)

    def _register(self, seq: Sequence, tables: list[list[int]], start: int, num_full: int) -> None:
        keys = self._keys(seq, num_full)
        P = self.page_size
        keep = [g.first_block(num_full * P, P) for g in self.groups]
        new_keys, new_blocks = [], []
        for i in range(start, num_full):
            for g, table in enumerate(tables):
                block_id = table[i]
                key = group_key(keys[i], g)
                # False with caching on: another block already holds this page, and it was
                # saved (or loaded from the store) when it was cached, so it is not saved again.
                cached = self.pool.cache_block(block_id, key)
                if (cached or not self.pool.enable_prefix_caching) and i >= keep[g]:
                    new_keys.append(key)
                    new_blocks.append(block_id)
        seq.num_registered_blocks = seq.num_saved_blocks = num_full
        if not self.save_to_store or not new_keys or self.store_down():
            return  # a page not saved is recomputed by whoever needs it
        # save_to_store needs a connector, and a connector the KV pool (set_connector)
        assert self.connector is not None and self._kv_pool is not None
        try:
            self.connector.save(new_keys, new_blocks, self._kv_pool())
        except Exception:  # the store is a cache: a failed save loses nothing
            logger.exception("kv connector save failed for request %s", seq.request_id)
            self.num_store_errors += 1

    def _release_behind_windows(self, seq: Sequence, tables: list[list[int]]) -> None:
        """Release each local group's blocks no query of `seq` reads any more; their saved
        pages are demoted in the store (its first to evict)."""
        behind: list[bytes] = []
        for g, (group, table) in enumerate(zip(self.groups, tables, strict=True)):
            if not group.local:
                continue
            first = min(group.first_block(seq.num_computed_tokens, self.page_size), len(table))
            i = first
            while i > 0 and table[i - 1] != RELEASED:
                i -= 1
            if i < first:
                self.pool.release(table[i:first])
                table[i:first] = [RELEASED] * (first - i)
                self.held_blocks[g] -= first - i
                full = min(first, len(seq.block_keys))
                behind.extend(group_key(k, g) for k in seq.block_keys[i:full])
        demote = getattr(self.connector, "demote", None)
        if behind and self.save_to_store and demote is not None:
            try:
                demote(behind)
            except Exception:  # a hint to the store: losing it loses nothing
                logger.debug("store demote failed for request %s", seq.request_id)
