"""StoreConnector with a real KV pool tensor shaped like SmolLM2's (no model needed)."""

from __future__ import annotations

import torch

from kvrelay.core.page_keys import page_keys
from kvrelay.kvstore.client import StoreClient
from kvrelay.kvstore.connector import StoreConnector
from kvrelay.kvstore.page import PageSpec
from kvrelay.workers.engine.kv_connector import KVConnector

SMOLLM2 = PageSpec("a" * 64, "float32", num_layers=30, page_size=16, kv_heads=3, head_dim=64)


def test_save_then_load_into_other_blocks(start_node):
    assert SMOLLM2.page_bytes == 737_280
    node = start_node(
        arena_bytes=4096 + 6 * 741_376,
        page_bytes=SMOLLM2.page_bytes,
        fingerprint=SMOLLM2.fingerprint,
    )
    keys = page_keys(list(range(64)), 16, SMOLLM2.fingerprint)
    torch.manual_seed(0)
    pool = torch.randn(8, 30, 2, 16, 3, 64)
    with StoreClient(node.config.run_dir, SMOLLM2) as client:
        conn = StoreConnector(client)
        assert isinstance(conn, KVConnector)
        assert conn.lookup(keys) == 0
        conn.save(keys[:3], [5, 1, 6], pool)
        conn.save(keys[:3], [0, 0, 0], pool)  # write-once: the first save stays
        assert conn.lookup(keys) == 3
        other = torch.zeros_like(pool)
        assert conn.load(keys, [2, 3, 4, 7], other) == 3
        assert torch.equal(other[2], pool[5]) and torch.equal(other[3], pool[1])
        assert torch.equal(other[4], pool[6]) and torch.equal(other[7], torch.zeros_like(pool[7]))
        assert conn.load(keys[3:4], [0], other) == 0  # a chain is looked up from its start
        assert client.stats()["pages"]["pinned"] == 0


def test_mismatched_pool_is_refused_and_a_dead_node_is_a_miss(start_node, tmp_path):
    node = start_node(arena_bytes=4096 + 2 * 741_376, page_bytes=SMOLLM2.page_bytes)
    keys = page_keys(list(range(16)), 16, SMOLLM2.fingerprint)
    with StoreClient(node.config.run_dir, SMOLLM2) as client:
        conn = StoreConnector(client)
        try:
            conn.save(keys, [0], torch.zeros(2, 30, 2, 16, 3, 64, dtype=torch.bfloat16))
            raise AssertionError("expected a StoreError")
        except Exception as exc:
            assert "KV pool blocks are (30, 2, 16, 3, 64) bfloat16" in str(exc)
    with StoreClient(tmp_path / "nowhere", SMOLLM2, timeout_s=0.2) as client:
        conn = StoreConnector(client)
        pool = torch.zeros(2, 30, 2, 16, 3, 64)
        assert conn.lookup(keys) == 0
        assert conn.load(keys, [0], pool) == 0
        conn.save(keys, [0], pool)  # logged, not raised: the engine keeps serving
