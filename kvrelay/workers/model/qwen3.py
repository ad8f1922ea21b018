"""Qwen3 (dense): Llama's layers with an RMSNorm over each head of q and of k (QK-norm, one
weight of head_dim per projection, the model's eps) after the projection and before RoPE; no
q/k/v biases; head_dim given by the config (128 in the released models, not hidden / heads).

The norms are row-local (kernels.rms_norm over the [tokens x heads, head_dim] rows), so a
token's logits stay the same in any batch; the C++ decoder (CpuDecoder) norms the same rows in
place with the same row function (`layer_spec_extras` gives it the weights): the same bits.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrelay.kernels import rms_norm
from kvrelay.workers.model.config import ModelConfig
from kvrelay.workers.model.llama import DecoderLayer, LlamaForCausalLM, RowDeltas


class Qwen3DecoderLayer(DecoderLayer):
    """A Llama layer plus the q and k norms."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__(config, dtype, device)
        self.q_norm = torch.ones(config.head_dim, dtype=dtype, device=device)
        self.k_norm = torch.ones(config.head_dim, dtype=dtype, device=device)

    def checkpoint_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            **super().checkpoint_weights(prefix),
            prefix + "self_attn.q_norm.weight": self.q_norm,
            prefix + "self_attn.k_norm.weight": self.k_norm,
        }


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3's decoder: `project_qkv` norms each head of q and k."""

    layer_class = Qwen3DecoderLayer

    def layer_spec_extras(self, index: int, layer: DecoderLayer) -> dict[str, Any]:
        assert isinstance(layer, Qwen3DecoderLayer)
        return {"q_norm": layer.q_norm, "k_norm": layer.k_norm}

    def project_qkv(
        self, layer: DecoderLayer, x: torch.Tensor, lora: RowDeltas | None = None, index: int = 0
    ) -> torch.Tensor:
        assert isinstance(layer, Qwen3DecoderLayer)
        c = self.config
        qkv = self.qkv_rows(layer, x, lora, index)
        rows, q, k = qkv.shape[0], c.q_size, c.kv_size
        eps = c.rms_norm_eps
        qkv[:, :q] = rms_norm(qkv[:, :q].reshape(-1, c.head_dim), layer.q_norm, eps).view(rows, q)
        normed_k = rms_norm(qkv[:, q : q + k].reshape(-1, c.head_dim), layer.k_norm, eps)
        qkv[:, q : q + k] = normed_k.view(rows, k)
        return qkv
