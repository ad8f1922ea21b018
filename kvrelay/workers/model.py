"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over the page-major paged KV pool.

Batch invariance (a token's logits are bitwise identical whatever else is in the batch, however
prefill is chunked, decode or prefill): on this CPU (MKL, AVX2) an fp32 matmul computes a row
identically for every row count that is a multiple of 4 (measured for all our shapes, 4..1032
rows, 1-3 threads), while 1-3 rows take a GEMV path and, with 2 threads, 5-11 rows differ too.
So every linear layer's input is padded to a multiple of ROW_ALIGN rows (4, the cheapest:
batch-1 decode costs 4 rows of compute, still below the memory-bound weight read). RMSNorm
and SiLU were measured row-invariant; RoPE uses a cos/sin table indexed by position (float64
math, computed once) and only mul/add at run time; attention is the kernels' invariant path.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.kernels import AttentionMetadata, paged_attention, write_kv
from kvrelay.workers.model_config import ModelConfig

logger = logging.getLogger(__name__)

ROW_ALIGN = 4


def padded_rows(n: int) -> int:
    """Rows a batch of `n` tokens is padded to (a multiple of ROW_ALIGN, at least one block)."""
    return max(ROW_ALIGN, -(-n // ROW_ALIGN) * ROW_ALIGN)


def allocate_kv_pool(
    config: ModelConfig,
    num_blocks: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Zeroed pool `[num_blocks, layers, 2, page_size, kv_heads, head_dim]`."""
    shape = (num_blocks, config.num_layers, 2, page_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


class DecoderLayer(nn.Module):
    """One pre-norm attention + SwiGLU MLP block with fused QKV and gate/up weights."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        c, kw = config, {"dtype": dtype, "device": device}
        qkv = c.q_size + 2 * c.kv_size
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size, **kw), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(c.hidden_size, **kw), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(qkv, c.hidden_size, **kw), requires_grad=False)
        self.qkv_bias = _maybe(c.qkv_bias, qkv, kw)
        self.o = nn.Parameter(torch.empty(c.hidden_size, c.q_size, **kw), requires_grad=False)
        self.o_bias = _maybe(c.o_bias, c.hidden_size, kw)
        self.gate_up = nn.Parameter(
            torch.empty(2 * c.intermediate_size, c.hidden_size, **kw), requires_grad=False
        )
        self.gate_up_bias = _maybe(c.mlp_bias, 2 * c.intermediate_size, kw)
        self.down = nn.Parameter(
            torch.empty(c.hidden_size, c.intermediate_size, **kw), requires_grad=False
        )
        self.down_bias = _maybe(c.mlp_bias, c.hidden_size, kw)


def _maybe(enabled: bool, size: int, kw: dict) -> nn.Parameter | None:
    return nn.Parameter(torch.zeros(size, **kw), requires_grad=False) if enabled else None


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM; `forward` writes the new tokens' K/V into the pool, then attends."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        kw = {"dtype": dtype, "device": self.device}
        self.embed = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, **kw), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, self.device) for _ in range(config.num_layers)
        )
        self.norm = nn.Parameter(torch.ones(config.hidden_size, **kw), requires_grad=False)
        if config.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = nn.Parameter(
                torch.empty(config.vocab_size, config.hidden_size, **kw), requires_grad=False
            )
        self.scale = config.head_dim**-0.5
        self._inv_freq = torch.tensor(config.inv_freq(), dtype=torch.float64)
        self._rope_cos = torch.empty(0, config.head_dim // 2, dtype=dtype, device=self.device)
        self._rope_sin = self._rope_cos

    def allocate_kv_pool(
        self, num_blocks: int, page_size: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A zeroed KV pool for this model on its device."""
        return allocate_kv_pool(
            self.config, num_blocks, page_size, dtype or self.dtype, self.device
        )

    def _rope_table(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Grown by doubling; every row depends only on its position, so growth changes nothing.
        if max_position >= self._rope_cos.shape[0]:
            n = max(1024, 1 << max_position.bit_length())
            angles = torch.arange(n, dtype=torch.float64)[:, None] * self._inv_freq[None, :]
            self._rope_cos = angles.cos().to(self.dtype).to(self.device)
            self._rope_sin = angles.sin().to(self.dtype).to(self.device)
        return self._rope_cos, self._rope_sin

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, H, D]; rotate halves (HF "rotate_half" convention): only mul/add, row-invariant.
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty_like(x)
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:] = x2 * cos + x1 * sin
        return out

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """fp32 logits [S, vocab] of the rows `logits_indices` of this step's T tokens."""
        c = self.config
        num_tokens = int(input_ids.shape[0])
        rows = padded_rows(num_tokens)
        ids = input_ids.to(self.device, torch.long)
        pos = positions.to(self.device, torch.long)
        if rows != num_tokens:  # pad rows: token 0 at position 0, never written nor attended
            ids = F.pad(ids, (0, rows - num_tokens))
            pos = F.pad(pos, (0, rows - num_tokens))
        # On CUDA the metadata bound avoids a device sync; on CPU the exact max is free.
        if ids.is_cuda:
            max_pos = int(meta.max_context_len)
        else:
            max_pos = int(pos.max()) if num_tokens else 0
        cos_table, sin_table = self._rope_table(max_pos)
        cos, sin = cos_table[pos][:, None, :], sin_table[pos][:, None, :]
        hidden = F.embedding(ids, self.embed)
        slots = meta.slot_mapping.to(self.device)
        heads_qk = c.num_heads + c.num_kv_heads
        attn_rows = hidden.new_zeros(rows, c.q_size) if rows != num_tokens else None
        for index, layer in enumerate(self.layers):
            x = F.rms_norm(hidden, (c.hidden_size,), layer.input_norm, c.rms_norm_eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            qk = self._rope(qkv[:, : heads_qk * c.head_dim].view(rows, heads_qk, -1), cos, sin)
            v = qkv[:num_tokens, heads_qk * c.head_dim :].view(num_tokens, c.num_kv_heads, -1)
            write_kv(kv_pool, index, qk[:num_tokens, c.num_heads :], v, slots)
            attn = paged_attention(qk[:num_tokens, : c.num_heads], kv_pool, index, meta, self.scale)
            if attn_rows is None:
                attn_in = attn.reshape(rows, c.q_size)
            else:
                attn_rows[:num_tokens] = attn.reshape(num_tokens, c.q_size)
                attn_in = attn_rows
            hidden = hidden + F.linear(attn_in, layer.o, layer.o_bias)
            x = F.rms_norm(hidden, (c.hidden_size,), layer.post_norm, c.rms_norm_eps)
            gate_up = F.linear(x, layer.gate_up, layer.gate_up_bias)
            act = F.silu(gate_up[:, : c.intermediate_size]) * gate_up[:, c.intermediate_size :]
            hidden = hidden + F.linear(act, layer.down, layer.down_bias)
        return self.compute_logits(hidden, logits_indices)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the selected rows (padded for invariance); fp32 [S, vocab]."""
        num = int(logits_indices.shape[0])
        selected = hidden[logits_indices.to(self.device, torch.long)]
        if padded_rows(num) != num:
            selected = F.pad(selected, (0, 0, 0, padded_rows(num) - num))
        x = F.rms_norm(selected, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head)[:num].float()
