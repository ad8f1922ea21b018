"""Plain torch reference ops (simple, per-sequence): the ground truth the fast paths match."""

from __future__ import annotations

import torch

from kvrelay.kernels.metadata import AttentionMetadata


def write_kv(
    kv_pool: torch.Tensor,
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot; negative slots are skipped."""
    page_size = kv_pool.shape[3]
    slots = slot_mapping
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    blocks = torch.div(slots, page_size, rounding_mode="floor")
    offsets = slots - blocks * page_size
    kv_pool[:, layer, 0].index_put_((blocks, offsets), key.to(kv_pool.dtype))
    kv_pool[:, layer, 1].index_put_((blocks, offsets), value.to(kv_pool.dtype))


def paged_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of each sequence's last query rows over its paged context (naive);
    window > 0: only the keys at positions p - window < k <= p."""
    num_heads = query.shape[1]
    page_size, num_kv_heads, head_dim = kv_pool.shape[3:]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    lens = meta.context_lens.tolist()
    for i, ctx in enumerate(lens):
        q = query[starts[i] : starts[i + 1]].float()  # [n, Hq, D]
        n = q.shape[0]
        if n == 0:
            continue
        num_pages = -(-ctx // page_size)
        blocks = meta.block_tables[i, :num_pages].long()
        kv = kv_pool[blocks, layer].float()  # [pages, 2, P, H, D]
        k = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[:ctx]
        k = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)
        k_pos = torch.arange(ctx).unsqueeze(0)
        hidden = k_pos > q_pos
        if window > 0:
            hidden = hidden | (k_pos <= q_pos - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def gather_pages(kv_pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Contiguous copy of whole pages (all layers, K and V) out of the pool."""
    return kv_pool.index_select(0, block_ids.to(torch.long))


def scatter_pages(kv_pool: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor) -> None:
    """Copy whole pages into the pool's blocks."""
    kv_pool.index_copy_(0, block_ids.to(torch.long), pages.to(kv_pool.dtype))


def rotate(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q and k rotated [T, H + KV, D], v [T, KV, D]) of a fused QKV row (HF rotate_half);
    elementwise per row, with no host sync (a CUDA graph can hold it)."""
    num_tokens, head_dim = qkv.shape[0], cos.shape[1] * 2
    half = head_dim // 2
    x = qkv[:, : (num_heads + kv_heads) * head_dim].reshape(num_tokens, -1, head_dim)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    out[..., :half] = x1 * c - x2 * s
    out[..., half:] = x2 * c + x1 * s
    v = qkv[:, (num_heads + kv_heads) * head_dim :].reshape(num_tokens, kv_heads, head_dim)
    return out, v


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Rotate q and k of a fused QKV row (HF rotate_half), write k and v; return q [T, H, D]."""
    out, v = rotate(qkv, positions, cos, sin, num_heads, kv_pool.shape[4])
    write_kv(kv_pool, layer, out[:, num_heads:], v, slot_mapping)
    return out[:, :num_heads]
