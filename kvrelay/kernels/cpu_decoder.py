"""A Llama-style decoder's layers in one C++ call on CPU (`CpuDecoder`).

The model's Python loop calls, per layer, a linear, RoPE with the K/V write, paged attention,
a linear, the residual add with the next norm, the gate/up linear (its activation fused or
`silu_mul`), the down linear and the next residual add: about ten calls, each with its
wrapper's checks. On a 2-core host that interpreter work was ~0.3 ms per layer (10-14% of a
step), with the other thread idle in its barrier all the while. `CpuDecoder.run` makes the
same kernel calls, in the same order, from C++ (bindings.cpp): the same bits, the per-layer
checks done once per step. It runs where every linear is a C++ one (w8a16, int8-weight-only,
q8_0) and attention is the C++ path's; elsewhere (`run` returns False) the model loops in
Python as before.

Gemma 3's layers add (LayerSpec): a sliding attention window per layer (one attention plan per
window in a step), a RoPE table pair per layer (`run` takes sequences of cos/sin tables),
RMSNorms of the o and down projections' outputs before their residual adds, and GeGLU
(`gelu_tanh_mul` after a plain gate/up linear).

KV groups (`kvrelay.core.kv_layout`): a layer lives in KV group `kv_group` at pool slot
`kv_slot` (the pool's dim 1; -1: its own index, as with one group). Each group has its own
block tables and slot mapping per step, so `run` takes one slot mapping and one
`AttentionMetadata` per group (or one of each for every group), and one attention plan is built
per group from its metadata and window: where there are several groups, the layers of a group
share one window (a local group's released pages may point at any block, which a full layer
would read); a single group may mix windows (one plan per window, as before groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from kvrelay.kernels import cpu_build, cpu_paged
from kvrelay.kernels.errors import KernelError
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.ops import MAX_WINDOW, check_rope_rows


class LinearKind(IntEnum):
    """How a linear's packed weight is applied (bindings.cpp `LinearKind`)."""

    W8A16 = 0  # `w8a16_linear`
    W8A16_GATE_UP_SILU = 1  # `w8a16_silu_linear`: a gate/up projection and its activation
    INT8 = 2  # `int8_linear` (int8-weight-only)
    Q8 = 3  # `q8_linear`


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """A C++ linear: its kind, its packed weight's tensors, bias and output count."""

    kind: LinearKind
    packed: torch.Tensor
    scales: torch.Tensor
    comp: torch.Tensor | None  # q8_0's block sums
    bias: torch.Tensor | None
    out_features: int

    def as_tuple(self) -> tuple:
        return (int(self.kind), self.packed, self.scales, self.comp, self.bias, self.out_features)


ACTIVATIONS = ("silu", "gelu_tanh")  # bindings.cpp `Activation`, in order


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One decoder layer: its two RMSNorm weights and four linears; a family's q and k head
    norms (Qwen3: both or neither) and whether RoPE rotates q and k (SmolLM3's NoPE layers);
    Gemma 3's attention window (0: full), RoPE table pair (an index into `run`'s cos/sin
    sequences), RMSNorms of the o projection's and the down projection's outputs (before
    their residual adds) and activation ("silu", or "gelu_tanh": `gelu_tanh_mul` after a
    plain gate/up linear); its KV group (an index into `run`'s slot mappings and metadata;
    groups 0 .. n-1, and where n > 1 the layers of one group share one window) and its slot in
    the pool's dim 1 (-1: the layer's index in the decoder's layers)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearSpec
    o: LinearSpec
    gate_up: LinearSpec
    down: LinearSpec
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    rope: bool = True
    window: int = 0
    rope_table: int = 0
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    activation: str = "silu"
    kv_group: int = 0
    kv_slot: int = -1


class CpuDecoder:
    """The layers `specs` of a model with `num_heads` query heads and RMSNorm `eps`."""

    def __init__(self, specs: list[LayerSpec], eps: float, num_heads: int):
        ext = cpu_build.load()
        if ext is None:
            raise KernelError("the C++ CPU kernels are not loaded")
        for s in specs:
            if s.activation not in ACTIVATIONS:
                raise KernelError(f"activation must be one of {ACTIVATIONS}, got {s.activation!r}")
            if s.activation == "gelu_tanh" and s.gate_up.kind == LinearKind.W8A16_GATE_UP_SILU:
                raise KernelError("a gelu_tanh layer needs a plain (unfused) gate/up linear")
            if s.window < 0 or s.rope_table < 0:
                raise KernelError("a layer's window and rope_table must be >= 0")
            if s.kv_group < 0 or s.kv_slot < -1:
                raise KernelError("a layer's kv_group must be >= 0 and its kv_slot >= -1")
        slots = [int(s.kv_slot) if s.kv_slot >= 0 else i for i, s in enumerate(specs)]
        groups = [int(s.kv_group) for s in specs]
        if len(set(zip(groups, slots, strict=True))) != len(specs):
            raise KernelError("two layers share one KV group's pool slot")
        group_windows: dict[int, set[int]] = {}
        for g, s in zip(groups, specs, strict=True):
            group_windows.setdefault(g, set()).add(min(int(s.window), MAX_WINDOW))
        if sorted(group_windows) != list(range(len(group_windows))):
            raise KernelError(f"KV groups must be 0 .. n-1, got {sorted(group_windows)}")
        if len(group_windows) > 1:  # one group (no KV layout): windows per layer, as before
            for g, windows in group_windows.items():
                if len(windows) > 1:
                    raise KernelError(
                        f"the layers of KV group {g} must share one window, got {sorted(windows)}"
                    )
        layers = [
            (
                s.input_norm.contiguous(),
                s.post_norm.contiguous(),
                s.qkv.as_tuple(),
                s.o.as_tuple(),
                s.gate_up.as_tuple(),
                s.down.as_tuple(),
                None if s.q_norm is None else s.q_norm.contiguous(),
                None if s.k_norm is None else s.k_norm.contiguous(),
                bool(s.rope),
            )
            for s in specs
        ]
        extras = [
            (
                min(int(s.window), MAX_WINDOW),
                int(s.rope_table),
                None if s.attn_out_norm is None else s.attn_out_norm.contiguous(),
                None if s.mlp_out_norm is None else s.mlp_out_norm.contiguous(),
                ACTIVATIONS.index(s.activation),
                g,
                slot,
            )
            for s, g, slot in zip(specs, groups, slots, strict=True)
        ]
        if any((s.q_norm is None) != (s.k_norm is None) for s in specs):
            raise KernelError("a layer's q and k head norms come together")
        self._impl: Any = ext.CpuDecoder(layers, float(eps), int(num_heads), extras)
        self.num_layers = len(specs)
        self.num_heads = int(num_heads)
        self._qkv_width = {s.qkv.out_features for s in specs}
        # KV groups 0 .. num_kv_groups - 1; the attention plans of a step: one per group and
        # window (one window per group but where a single group mixes them)
        self.num_kv_groups = len(group_windows) or 1
        self._plan_keys = [(g, w) for g in sorted(group_windows) for w in sorted(group_windows[g])]
        self._max_slot = max(slots, default=0)
        # the RoPE tables `run` needs: one more than the largest index a rotating layer takes
        self._rope_tables = 1 + max((s.rope_table for s in specs if s.rope), default=0)

    def run(
        self,
        hidden: torch.Tensor,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor | Sequence[torch.Tensor],
        sin: torch.Tensor | Sequence[torch.Tensor],
        kv_pool: torch.Tensor,
        slot_mapping: torch.Tensor | Sequence[torch.Tensor],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
        scale: float,
    ) -> bool:
        """Every layer on x (the first layer's normed input) with the residual stream `hidden`
        [T, hidden] updated in place, as the Python loop would; False (nothing done) where
        this step is not one the C++ path takes, and the caller loops in Python (whose checks
        then say what is wrong). cos/sin: one RoPE table pair [N, D/2], or sequences of them
        (a layer takes the pair at its `rope_table`). slot_mapping/meta: one per KV group
        (`num_kv_groups` of each), or one tensor/metadata that every group uses."""
        groups = self.num_kv_groups
        if isinstance(slot_mapping, torch.Tensor):
            slot_mappings = [slot_mapping] * groups
        else:
            slot_mappings = list(slot_mapping)
        metas = [meta] * groups if isinstance(meta, AttentionMetadata) else list(meta)
        cos_tables = [cos] if isinstance(cos, torch.Tensor) else list(cos)
        sin_tables = [sin] if isinstance(sin, torch.Tensor) else list(sin)
        if not self._takes(
            hidden, x, cos_tables, sin_tables, kv_pool, slot_mappings, positions, metas
        ):
            return False
        num_tokens = int(positions.shape[0])
        if num_tokens == 0:
            return False
        rows = min(c.shape[0] for c in cos_tables[: self._rope_tables])
        checked: set[int] = set()
        for slots in slot_mappings:  # once per step and slot mapping, not per layer
            if id(slots) not in checked:
                checked.add(id(slots))
                check_rope_rows(positions, slots, rows, kv_pool)
        page_size, num_blocks = kv_pool.shape[3], kv_pool.shape[0]
        plans = []
        for group, window in self._plan_keys:
            meta_g = metas[group]
            plan = cpu_paged.get_plan(meta_g, page_size, num_blocks, num_tokens, window)
            plans.append(
                (
                    group,
                    window,
                    plan.block_tables,
                    slot_mappings[group].contiguous(),
                    plan.items,
                    plan.entries,
                    plan.positions,
                    plan.chunk_offsets,
                    plan.chunk_pages,
                )
            )
        self._impl.forward(
            hidden,
            x,
            positions.to(torch.int64).contiguous(),
            [c.contiguous() for c in cos_tables],
            [s.contiguous() for s in sin_tables],
            kv_pool,
            plans,
            float(scale),
            metas[0].precision == "bf16",
        )
        return True

    def _takes(
        self,
        hidden: torch.Tensor,
        x: torch.Tensor,
        cos_tables: list[torch.Tensor],
        sin_tables: list[torch.Tensor],
        kv_pool: torch.Tensor,
        slot_mappings: list[torch.Tensor],
        positions: torch.Tensor,
        metas: list[AttentionMetadata],
    ) -> bool:
        """Whether the kernels the Python loop would pick for this step are all C++ ones
        (shapes as the model makes them; anything else goes to the loop)."""
        if len(slot_mappings) != self.num_kv_groups or len(metas) != self.num_kv_groups:
            return False
        num_tokens = int(positions.shape[0]) if positions.dim() == 1 else -1
        if not (
            hidden.dtype == x.dtype == torch.float32
            and hidden.is_cpu
            and x.is_cpu
            and hidden.is_contiguous()
            and x.is_contiguous()
            and hidden.dim() == x.dim() == 2
            and hidden.shape[0] == x.shape[0] == num_tokens
            and all(
                isinstance(s, torch.Tensor)
                and s.shape == positions.shape
                and s.dtype == torch.int64
                and s.is_cpu
                for s in slot_mappings
            )
            and kv_pool.dim() == 6
            and kv_pool.shape[2] == 2
            and kv_pool.shape[1] > self._max_slot
            and self.num_heads % kv_pool.shape[4] == 0
            and self._qkv_width == {(self.num_heads + 2 * kv_pool.shape[4]) * kv_pool.shape[5]}
        ):
            return False
        if len(cos_tables) != len(sin_tables) or len(cos_tables) < self._rope_tables:
            return False
        for cos, sin in zip(cos_tables, sin_tables, strict=True):
            if not (
                cos.dtype == sin.dtype == torch.float32
                and cos.is_cpu
                and sin.is_cpu
                and cos.shape == sin.shape
                and cos.dim() == 2
                and cos.shape[1] == kv_pool.shape[5] // 2
            ):
                return False
        precision = getattr(metas[0], "precision", None)
        for meta in metas:
            if not isinstance(meta, AttentionMetadata) or meta.precision != precision:
                return False
            num_seqs = meta.context_lens.shape[0]
            if (
                meta.query_start_loc.shape[0] != num_seqs + 1
                or meta.block_tables.dim() != 2
                or meta.block_tables.shape[0] != num_seqs
            ):
                return False
        query = torch.empty((0, self.num_heads, kv_pool.shape[5]))  # shape and dtype only
        if not cpu_paged.supports(query, kv_pool):
            return False
        if precision == "bf16":
            return (
                cpu_paged.bf16_attention_available()
                and kv_pool.dtype == torch.bfloat16
                and kv_pool.shape[3] % 16 == 0
                and kv_pool.shape[5] in cpu_paged.BF16_HEAD_DIMS
            )
        return precision == "fp32"
