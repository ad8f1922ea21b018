"""How a model's layers share the KV pool and the page store (`KVLayout`).

Every layer attends either to the whole context or to a sliding window of its last W tokens
(Gemma 3's local layers, Mistral's every layer). A windowed layer never reads a page wholly
behind its window, so its pages need not be kept: the layers are split into *KV groups* of one
kind each, and each group has its own block table per sequence. A full group's table holds
every page of the sequence; a local group's drops (releases to the pool) the pages its window
has left behind, so a sequence's memory in local layers is bounded by the window.

All groups hold the same number of layers (`group_size`: the gcd of the kinds' layer counts),
so one pool of equal blocks `[num_blocks, group_size, 2, page_size, kv_heads, head_dim]` and
one `BlockPool` serve every group, and a block is one page of the store whatever its group
(vLLM's hybrid allocator does the same). Gemma 3 270M (15 local, 3 full layers): six groups of
three layers, group 0 full. A model of one kind has one group of all its layers: its pool,
pages and keys are what they were before groups existed.

A group's page of the token block i is stored under `group_key(key_i, g)`: group 0's keys are
the plain chained page keys (so routing and single-group models are unchanged), the others a
hash of (key, g). Torch-free: the store sizes its pages from this too.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.core.page_keys import KEY_BYTES


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers sharing one block table: `window` 0 attend to the whole context, W > 0 to their
    last W positions (keys p - W < k <= p)."""

    layers: tuple[int, ...]
    window: int = 0

    @property
    def local(self) -> bool:
        return self.window > 0

    def first_block(self, num_tokens: int, page_size: int) -> int:
        """The first block a query at position `num_tokens` (the next token) still reads: all
        blocks for a full group; for a local one, the block of position num_tokens - W + 1."""
        if not self.window:
            return 0
        return max(0, num_tokens - self.window + 1) // page_size


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV groups of a model; layer l lives in group `layer_group[l]` at pool slot
    `layer_slot[l]` (its index in the pool's second dimension)."""

    groups: tuple[KVGroup, ...]
    group_size: int
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @classmethod
    def from_windows(cls, num_layers: int, windows: Sequence[int] = ()) -> KVLayout:
        """The layout of `num_layers` layers with per-layer `windows` (() or all 0: one full
        group). Groups of full layers come first, then local ones by window."""
        if num_layers < 1:
            raise ValueError(f"a model has at least one layer, got {num_layers}")
        windows = tuple(int(w) for w in windows) or (0,) * num_layers
        if len(windows) != num_layers or min(windows) < 0:
            raise ValueError(f"one window >= 0 per layer ({num_layers}), got {windows}")
        kinds = sorted(set(windows))
        by_kind = {w: [i for i, lw in enumerate(windows) if lw == w] for w in kinds}
        size = math.gcd(*(len(v) for v in by_kind.values()))
        groups: list[KVGroup] = []
        layer_group = [0] * num_layers
        layer_slot = [0] * num_layers
        for w in kinds:
            layers = by_kind[w]
            for start in range(0, len(layers), size):
                members = tuple(layers[start : start + size])
                for slot, layer in enumerate(members):
                    layer_group[layer] = len(groups)
                    layer_slot[layer] = slot
                groups.append(KVGroup(members, w))
        return cls(tuple(groups), size, tuple(layer_group), tuple(layer_slot))

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> KVLayout:
        """The layout of a (flattened) config.json's model."""
        return cls.from_windows(int(cfg["num_hidden_layers"]), layer_windows(cfg))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def has_local(self) -> bool:
        return any(g.local for g in self.groups)

    def describe(self) -> str:
        """One line for logs: '6 KV groups of 3 layers: 1 full, 5 local (window 512)'."""
        full = sum(not g.local for g in self.groups)
        local = sorted({g.window for g in self.groups if g.local})
        text = f"{self.num_groups} KV group(s) of {self.group_size} layer(s): {full} full"
        if local:
            wins = ", ".join(str(w) for w in local)
            text += f", {self.num_groups - full} local (window {wins})"
        return text


def group_key(key: bytes, group: int) -> bytes:
    """The key of group `group`'s page of the token block keyed `key` (group 0: `key`)."""
    if group == 0:
        return key
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(key)
    h.update(b"|kv-group|")
    h.update(group.to_bytes(4, "little"))
    return h.digest()


def layer_windows(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's attention window from a (flattened) config.json: Gemma 3's `layer_types`
    (sliding_attention layers see `sliding_window` tokens, full_attention ones all; older
    configs: every `sliding_window_pattern`-th layer full), Mistral's `sliding_window` on every
    layer; () where every layer attends to the whole context (Qwen2/3's windows, which
    `core.modelref.context_length` keeps out of reach, included). ValueError on a config it
    cannot read."""
    model_type = str(cfg.get("model_type", "")).lower()
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        window = 0
    layers = int(cfg["num_hidden_layers"])
    if model_type == "mistral":
        return (window,) * layers if window else ()
    if model_type not in ("gemma3_text", "gemma3"):
        return ()
    kinds = cfg.get("layer_types")
    if kinds is None:  # the pattern older configs carry: every n-th layer global
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        kinds = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ValueError(f"layer_types must list {layers} layers, got {kinds!r}")
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported")
    if "sliding_attention" in kinds and not window:
        raise ValueError("sliding_attention layers need a sliding_window")
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
