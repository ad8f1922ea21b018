"""Phi-3 / Phi-4-mini: Llama's layers with fused checkpoint tensors (`qkv_proj`, `gate_up_proj`,
which our layers fuse anyway), LongRoPE (config.py: the short factors and the attention factor
on cos and sin; the context is capped at the pretraining length), and, in Phi-4-mini, RoPE on
the first 3/4 of each head's dims only.

Partial rotary without a kernel of its own: transformers rotates dim i with dim i + r/2 for
i < r/2 (r = rotary_dim) and leaves dims r.. as they are; our RoPE kernels pair dim i with
i + D/2 over the whole head. `after_load` permutes each q and k head's output rows so that the
rotated pairs sit at (i, i + D/2) for i < r/2 and the unrotated dims fill the rest, whose
frequencies are zero (cos 1, sin 0, unscaled). q and k are permuted alike, so every q . k is
the one transformers computes; v and the outputs are untouched; the C++ decoder needs nothing.
"""

from __future__ import annotations

import torch

from kvrelay.workers.model.llama import DecoderLayer, LlamaForCausalLM


class Phi3DecoderLayer(DecoderLayer):
    """A Llama layer read from Phi-3's fused checkpoint tensors."""

    def checkpoint_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        dest = {
            prefix + "input_layernorm.weight": self.input_norm,
            prefix + "post_attention_layernorm.weight": self.post_norm,
        }
        for name, layer in (
            ("self_attn.qkv_proj", self.qkv),
            ("self_attn.o_proj", self.o),
            ("mlp.gate_up_proj", self.gate_up),
            ("mlp.down_proj", self.down),
        ):
            for kind in ("weight", "bias"):
                if getattr(layer, kind) is not None:
                    dest[prefix + f"{name}.{kind}"] = getattr(layer, kind)
        return dest


def head_order(head_dim: int, rotary_dim: int) -> list[int]:
    """new dim p of a head <- transformers' dim order[p]: rotated pairs at (i, i + D/2)."""
    half, rot = head_dim // 2, rotary_dim // 2
    rest = iter(range(rotary_dim, head_dim))
    first = list(range(rot)) + [next(rest) for _ in range(half - rot)]
    second = list(range(rot, rotary_dim)) + list(rest)
    return first + second


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3's decoder: fused names, and q/k dims rearranged for partial rotary."""

    layer_class = Phi3DecoderLayer

    def after_load(self) -> None:
        c = self.config
        if not c.rotary_dim:
            return
        order = torch.tensor(head_order(c.head_dim, c.rotary_dim))
        heads = c.num_heads + c.num_kv_heads  # q's heads, then k's (v stays)
        rows = (torch.arange(heads)[:, None] * c.head_dim + order[None, :]).reshape(-1)
        for layer in self.layers:
            for kind in ("weight", "bias"):
                tensor = getattr(layer.qkv, kind)
                if tensor is not None:
                    qk = tensor[: heads * c.head_dim]
                    qk.copy_(qk[rows.to(qk.device)])
