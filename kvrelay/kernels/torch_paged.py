"""Batch- and path-invariant paged attention in torch (the CPU path).

Every query row gets the same floating-point operations whatever else is in the batch:
- scores: matmuls with a fixed contraction (head_dim) and row counts that are multiples of 4
  (measured: MKL then computes each row the same way for any row count, column count, batch
  size or thread count 1-8; 1-3 and 5-7 rows take other kernels);
- softmax max: exact, so its grouping does not matter; exp is elementwise (measured: the same
  bits for any slice, layout or thread count, once MKL has picked its exp kernel, which
  importing kvrelay.kernels settles);
- per key tile of fixed length: row sums over the tile and P@V with a fixed contraction;
- tiles are accumulated in tile order by index_add_ (sequential, starting from zero), so tiles
  that are fully masked for a row add exact zeros and change nothing.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import torch

from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.plan import BigSeq, SmallGroup, get_plan
from kvrelay.kernels.torch_ref import gather_pages, scatter_pages, write_kv

__all__ = ["gather_pages", "paged_attention", "scatter_pages", "write_kv"]

NEG_INF = float("-inf")
# exp of -inf or of anything below ~-87 (denormal results) is up to 8x slower on x86: clamp the
# exponent, then put exact zeros back at masked keys (fully masked tiles must add exact zeros).
MIN_EXPONENT = -87.0


class _Workspace(threading.local):
    """Scratch buffers reused across calls: fresh multi-MB tensors cost page faults each time."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.float32)
            self.buffers[name] = buf
        return buf[:numel].view(shape)


_ws = _Workspace()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run MKL's batches of tiny matmuls on one thread (same bits for any thread count).

    With 2 threads MKL splits each tiny matmul and synchronises per matrix: measured 1-13 ms
    for 480 4x64x128 products on a busy 2-core box, 0.9 ms on one thread.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def release_workspace() -> None:
    """Free this thread's scratch buffers."""
    _ws.buffers.clear()


def paged_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal paged attention, bitwise independent of batch composition and chunking; window
    > 0: each row sees only its last `window` positions (masked, plan.py)."""
    num_tokens, num_heads, head_dim = query.shape
    kv_heads = kv_pool.shape[4]
    group = num_heads // kv_heads
    plan = get_plan(meta, kv_pool.shape[3], group, kv_pool.shape[0], num_tokens, window)
    # Per kv head, a table of query rows (token * group + g), plus one zero row for padding.
    qtab = query.new_zeros((kv_heads, num_tokens * group + 1, head_dim), dtype=torch.float32)
    q = query.reshape(num_tokens, kv_heads, group, head_dim).transpose(0, 1).float() * scale
    qtab[:, : num_tokens * group] = q.reshape(kv_heads, num_tokens * group, head_dim)
    res = query.new_zeros((kv_heads, num_tokens * group, head_dim), dtype=torch.float32)
    keys, values = kv_pool[:, layer, 0], kv_pool[:, layer, 1]
    for grp in plan.small:
        _small(grp, qtab, keys, values, res, plan.tile)
    for seq in plan.big:
        _big(seq, qtab, keys, values, res, plan.tile)
    out = res.view(kv_heads, num_tokens, group, head_dim).transpose(0, 1)
    return out.reshape(num_tokens, num_heads, head_dim).to(query.dtype)


def _gather(name: str, pages: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Contiguous float32 copy of whole pages [n, page_size, kv_heads, head_dim]."""
    if pages.dtype != torch.float32:
        return pages.index_select(0, blocks).float()
    out = _ws.get(name, (blocks.shape[0], *pages.shape[1:]))
    return torch.index_select(pages, 0, blocks, out=out)


def _small(grp: SmallGroup, qtab, keys, values, res, tile: int) -> None:
    kv_heads, head_dim = keys.shape[2], keys.shape[3]
    n, rows, units = grp.num_items, grp.rows, grp.num_units
    # K is gathered right before its matmul and V right before its own: each copy is then
    # still in the last-level cache when it is read.
    k = _gather("k", keys, grp.blocks).view(n, tile, kv_heads, head_dim)
    q = qtab[:, grp.q_rows]  # [kv_heads, items, rows, head_dim]
    s = _ws.get("s", (kv_heads, n, rows, tile))
    with _one_thread():
        for h in range(kv_heads):
            torch.bmm(q[h], k[:, :, h].transpose(1, 2), out=s[h])
    if grp.mask_idx.numel():
        s.view(kv_heads, -1).index_fill_(1, grp.mask_idx, NEG_INF)
    uoi = grp.unit_of_item
    m = s.new_full((kv_heads, units, rows), NEG_INF)
    m.scatter_reduce_(1, uoi[None, :, None].expand(kv_heads, n, rows), s.amax(-1), "amax")
    s.sub_(m[:, uoi].unsqueeze(-1)).clamp_min_(MIN_EXPONENT).exp_()
    if grp.mask_idx.numel():
        s.view(kv_heads, -1).index_fill_(1, grp.mask_idx, 0.0)
    denom = s.new_zeros((kv_heads, units, rows)).index_add_(1, uoi, s.sum(-1))
    v = _gather("v", values, grp.blocks).view(n, tile, kv_heads, head_dim)
    if grp.vzero_rows.numel():
        # Slots past the context may hold stale values; their weight is 0, keep 0 * v == 0.
        v.view(n * tile, kv_heads * head_dim).index_fill_(0, grp.vzero_rows, 0.0)
    o_items = _ws.get("o", (kv_heads, n, rows, head_dim))
    with _one_thread():
        for h in range(kv_heads):
            torch.bmm(s[h], v[:, :, h], out=o_items[h])
    o = s.new_zeros((kv_heads, units, rows, head_dim)).index_add_(1, uoi, o_items)
    o.div_(denom.unsqueeze(-1))
    res.index_copy_(1, grp.out_rows, o.view(kv_heads, units * rows, head_dim)[:, grp.src_rows])


def _big(seq: BigSeq, qtab, keys, values, res, tile: int) -> None:
    kv_heads, head_dim = keys.shape[2], keys.shape[3]
    # Per-head contiguous copies [kv_heads, keys, head_dim]: one bmm per unit, not per head.
    num_keys = seq.blocks.shape[0] * keys.shape[1]
    k = _ws.get("kh", (kv_heads, num_keys, head_dim))
    k.copy_(_gather("k", keys, seq.blocks).view(num_keys, kv_heads, head_dim).transpose(0, 1))
    v = _ws.get("vh", (kv_heads, num_keys, head_dim))
    v.copy_(_gather("v", values, seq.blocks).view(num_keys, kv_heads, head_dim).transpose(0, 1))
    v[:, seq.context_len :] = 0.0
    for unit in seq.units:
        rows, num_tiles = unit.q_rows.shape[0], unit.num_tiles
        width = num_tiles * tile
        q = qtab[:, unit.q_rows]  # [kv_heads, rows, head_dim]
        s = _ws.get("s", (kv_heads, rows, width))
        torch.bmm(q, k[:, :width].transpose(1, 2), out=s)
        s[:, :, unit.mask_start :].masked_fill_(unit.mask, NEG_INF)  # mask_start is tile-aligned
        m = s.amax(-1, keepdim=True)
        # Probabilities laid out per tile [kv_heads, tiles, rows, tile], like the small path.
        p = _ws.get("p", (kv_heads, num_tiles, rows, tile))
        torch.sub(s.view(kv_heads, rows, num_tiles, tile), m.unsqueeze(-1), out=p.transpose(1, 2))
        p.clamp_min_(MIN_EXPONENT).exp_()
        masked = num_tiles - unit.mask.shape[1] // tile
        p.transpose(1, 2)[:, :, masked:].masked_fill_(unit.mask.view(rows, -1, tile), 0.0)
        zeros = torch.zeros(num_tiles, dtype=torch.long)
        denom = s.new_zeros((kv_heads, 1, rows)).index_add_(1, zeros, p.sum(-1))
        o_tiles = _ws.get("o", (kv_heads, num_tiles, rows, head_dim))
        for h in range(kv_heads):
            torch.bmm(p[h], v[h, :width].view(num_tiles, tile, head_dim), out=o_tiles[h])
        o = s.new_zeros((kv_heads, rows, head_dim))
        # A unit stride on the indexed dim sends index_add_ to its scatter kernel: one parallel
        # region, same sequential adds; the default path opens one region per tile.
        o.as_strided((kv_heads, 1, rows, head_dim), (rows * head_dim, 1, head_dim, 1)).index_add_(
            1, zeros, o_tiles
        )
        o.div_(denom.view(kv_heads, rows, 1))
        valid = unit.out_rows.shape[0]
        res[:, unit.out_rows] = o[:, :valid]
