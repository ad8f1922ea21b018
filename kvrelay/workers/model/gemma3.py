"""Gemma 3 (text: 270M, 1B, and the language model of the larger ones): Qwen3's QK-norm layers
with Gemma's own pieces, each a config field or a hook of the shared decoder (llama.py):
- interleaved local and global layers (`layer_types`: five sliding_attention layers of
  `sliding_window` tokens, then one full_attention layer), the local ones rotating with their
  own RoPE base (10,000, the global ones 1,000,000 and maybe scaled): `ModelConfig.window` and
  `ModelConfig.rope_set`;
- Gemma's RMSNorm, x * (1 + w): the checkpoint holds w, `after_load` stores 1 + w (the sum
  transformers computes in fp32 each call), so every norm kernel applies it as is;
- norms before and after both the attention and the MLP (`attn_out_norm`, `mlp_out_norm`), a
  GeGLU MLP (tanh-approximated GELU), the attention scaled by `query_pre_attn_scalar`^-1/2;
- the embeddings multiplied by sqrt(hidden_size) (rounded to the weights' dtype first, as
  transformers does), the LM head tied to them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvrelay.workers.model.config import ModelConfig
from kvrelay.workers.model.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


class Gemma3DecoderLayer(Qwen3DecoderLayer):
    """A QK-norm layer with norms on the attention's and the MLP's outputs.

    Checkpoint names: `post_attention_layernorm` is the norm on the attention's output and
    `pre_feedforward_layernorm` the MLP's input norm (Llama's `post_attention_layernorm`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__(config, dtype, device)
        self.attn_out_norm = torch.ones(config.hidden_size, dtype=dtype, device=device)
        self.mlp_out_norm = torch.ones(config.hidden_size, dtype=dtype, device=device)

    def norms(self) -> list[torch.Tensor]:
        """Every RMSNorm weight of the layer (stored as 1 + w once loaded)."""
        assert self.attn_out_norm is not None and self.mlp_out_norm is not None
        return [
            self.input_norm,
            self.post_norm,
            self.attn_out_norm,
            self.mlp_out_norm,
            self.q_norm,
            self.k_norm,
        ]

    def checkpoint_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        dest = super().checkpoint_weights(prefix)
        assert self.attn_out_norm is not None and self.mlp_out_norm is not None
        dest[prefix + "pre_feedforward_layernorm.weight"] = self.post_norm
        dest[prefix + "post_attention_layernorm.weight"] = self.attn_out_norm
        dest[prefix + "post_feedforward_layernorm.weight"] = self.mlp_out_norm
        return dest


class Gemma3ForCausalLM(Qwen3ForCausalLM):
    """Gemma 3's decoder: scaled embeddings, (1 + w) norms; the rest is the config's."""

    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__(config, dtype, device)
        # transformers: a float32 buffer of sqrt(hidden), cast to the embedding's dtype
        scale = torch.tensor(math.sqrt(config.hidden_size), dtype=torch.float32)
        self.embed_scale = scale.to(dtype=dtype, device=self.device)

    def after_load(self) -> None:
        super().after_load()
        norms = [self.norm]
        for layer in self.layers:
            assert isinstance(layer, Gemma3DecoderLayer)
            norms += layer.norms()
        for weight in norms:  # 1 + w in fp32, then the model's dtype (transformers' order)
            weight.copy_((1.0 + weight.float()).to(weight.dtype))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed) * self.embed_scale
