"""SmolLM3: Llama's layers, but every `no_rope_layer_interval`-th one (4: layers 3, 7, 11, ...,
as the config's `no_rope_layers` lists them, 0 = no RoPE) attends without rotary embeddings
(NoPE): its q and k are used as projected, k and v written to the pool as they are.

The C++ decoder (CpuDecoder) skips the rotation on the same layers (`layer_spec_extras`) and
writes K/V with the same kernel: the same bits as the Python loop.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrelay.kernels import write_kv
from kvrelay.workers.model.llama import DecoderLayer, LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3's decoder: `write_kv` skips RoPE on the config's NoPE layers."""

    def layer_spec_extras(self, index: int, layer: DecoderLayer) -> dict[str, Any]:
        return {"rope": self.config.uses_rope(index)}

    def write_kv(
        self,
        index: int,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        c = self.config
        if c.uses_rope(index):
            return super().write_kv(index, qkv, positions, rope, kv_pool, slots)
        tokens, q, kv = qkv.shape[0], c.q_size, c.kv_size
        key = qkv[:, q : q + kv].reshape(tokens, c.num_kv_heads, c.head_dim)
        value = qkv[:, q + kv :].reshape(tokens, c.num_kv_heads, c.head_dim)
        write_kv(kv_pool, index, key, value, slots)
        return qkv[:, :q].reshape(tokens, c.num_heads, c.head_dim).contiguous()
