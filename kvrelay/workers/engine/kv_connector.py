"""The engine's only view of the KV page store (implemented by kvstore.connector.StoreConnector)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class StoreLiveness(Protocol):
    """What a connector may expose as `liveness` (optional): whether its store node is down now
    (its process gone, told by its socket: not a slow reply) and how many times it was lost
    (up -> down). The engine asks no down node, and gives up on a fetch once its node is lost."""

    @property
    def down(self) -> bool: ...

    @property
    def losses(self) -> int: ...


@runtime_checkable
class KVConnector(Protocol):
    """Pages keyed by chained page keys; a worker block is byte-identical to a store page."""

    def lookup(self, keys: list[bytes]) -> int:
        """How many of the leading `keys` the store holds."""
        ...

    def load(self, keys: list[bytes], block_ids: list[int], kv_pool: torch.Tensor) -> int:
        """Copy pages into `kv_pool[block_ids]`; returns the leading count that verified."""
        ...

    def save(self, keys: list[bytes], block_ids: list[int], kv_pool: torch.Tensor) -> None:
        """Write-once put of `kv_pool[block_ids]` under `keys`; copies before returning."""
        ...
