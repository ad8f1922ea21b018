"""Store fixtures: in-process store nodes (a thread each) on private run dirs and arenas."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvrelay.core.page_keys import page_keys
from kvrelay.kvstore.config import StoreConfig
from kvrelay.kvstore.page import PageSpec
from kvrelay.kvstore.server import StoreNode, arena_path

FP = "f" * 32
SMALL = PageSpec(FP, "float32", num_layers=2, page_size=4, kv_heads=2, head_dim=8)  # 1 KiB pages


def payload(spec: PageSpec, i: int) -> np.ndarray:
    """A deterministic, distinct page payload."""
    rng = np.random.default_rng(i)
    return rng.standard_normal(spec.page_bytes // 4).astype(np.float32)


def keys_for(n: int, spec: PageSpec = SMALL, salt: str = "") -> list[bytes]:
    tokens = list(range(n * spec.page_size))
    return page_keys(tokens, spec.page_size, spec.fingerprint, salt)


class RunningNode:
    """A StoreNode serving from a thread."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self.node = StoreNode(config, config.page_bytes)
        self.node.start()
        self.thread = threading.Thread(target=self.node.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.node.stop()
            self.thread.join(timeout=10)
            self.node.close()


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[Callable[..., RunningNode]]:
    """start_node(**config overrides) -> RunningNode; all stopped and their arenas removed."""
    nodes: list[RunningNode] = []

    def start(**overrides) -> RunningNode:
        settings = {
            "node_id": "n0",
            "run_dir": str(tmp_path / "run"),
            "arena_bytes": 64 << 10,
            "page_bytes": SMALL.page_bytes,
            "tcp_port": 0,
            "ucx_port": -1,
            **overrides,
        }
        node = RunningNode(StoreConfig(**settings))
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.stop()
    for node in nodes:
        arena_path(node.config).unlink(missing_ok=True)
