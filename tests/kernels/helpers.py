"""Build paged KV pools and metadata from dense per-sequence K/V, and a dense reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kernels import AttentionMetadata, write_kv


@dataclass(slots=True)
class Case:
    """A filled pool, the dense K/V it holds, and a batch's queries + metadata."""

    kv_pool: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [ctx, H, D]
    values: list[torch.Tensor]
    tables: list[list[int]]  # per sequence block ids
    query: torch.Tensor
    meta: AttentionMetadata


def make_pool(num_blocks, num_layers, page_size, kv_heads, head_dim, dtype=torch.float32):
    return torch.zeros(num_blocks, num_layers, 2, page_size, kv_heads, head_dim, dtype=dtype)


def build_meta(tables, ctx_lens, query_lens, page_size, device="cpu") -> AttentionMetadata:
    """Metadata whose query rows are the last query_lens[i] positions of each sequence."""
    width = max(1, max(len(t) for t in tables))
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    slots = []
    for t, ctx, n in zip(tables, ctx_lens, query_lens, strict=True):
        slots += [t[p // page_size] * page_size + p % page_size for p in range(ctx - n, ctx)]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=bt.to(device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_context_len=max(ctx_lens),
    )


def meta_on(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    """The same metadata with its tensors on `device`."""
    return AttentionMetadata(
        meta.slot_mapping.to(device),
        meta.block_tables.to(device),
        meta.context_lens.to(device),
        meta.query_start_loc.to(device),
        meta.max_query_len,
        meta.max_context_len,
    )


def make_case(
    ctx_lens,
    query_lens,
    *,
    heads=6,
    kv_heads=2,
    head_dim=16,
    page_size=4,
    num_layers=2,
    layer=1,
    seed=0,
    dtype=torch.float32,
) -> Case:
    """Random K/V written page by page into shuffled blocks, plus random queries."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = [-(-c // page_size) for c in ctx_lens]
    num_blocks = sum(pages_needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in pages_needed:
        tables.append(perm[at : at + n])
        at += n
    pool = make_pool(num_blocks, num_layers, page_size, kv_heads, head_dim, dtype)
    keys = [torch.randn(c, kv_heads, head_dim, generator=g).to(dtype) for c in ctx_lens]
    values = [torch.randn(c, kv_heads, head_dim, generator=g).to(dtype) for c in ctx_lens]
    full = build_meta(tables, ctx_lens, ctx_lens, page_size)
    write_kv(pool, layer, torch.cat(keys), torch.cat(values), full.slot_mapping)
    meta = build_meta(tables, ctx_lens, query_lens, page_size)
    query = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    return Case(pool, keys, values, tables, query, meta)


def dense_reference(case: Case, query_lens, scale: float) -> torch.Tensor:
    """float64 causal attention on the dense K/V, independent of the paging code."""
    outs, at = [], 0
    for k, v, n in zip(case.keys, case.values, query_lens, strict=True):
        q = case.query[at : at + n].double()
        at += n
        ctx = k.shape[0]
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, 1)
        vv = v.double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * scale
        pos = torch.arange(ctx - n, ctx)[:, None]
        s = s.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.cat(outs)


@dataclass(slots=True)
class SeqData:
    """One sequence's full K/V and queries (one row per position)."""

    keys: torch.Tensor  # [L, kv_heads, D]
    values: torch.Tensor
    queries: torch.Tensor  # [L, heads, D]


def random_seq(length, heads=9, kv_heads=3, head_dim=64, seed=0) -> SeqData:
    g = torch.Generator().manual_seed(seed)
    return SeqData(
        torch.randn(length, kv_heads, head_dim, generator=g),
        torch.randn(length, kv_heads, head_dim, generator=g),
        torch.randn(length, heads, head_dim, generator=g),
    )


def attend_batch(
    specs,
    *,
    page_size=16,
    seed=0,
    scale=0.125,
    impl="auto",
    device="cpu",
    kv_dtype=None,
    precision="fp32",
    window=0,
):
    """Attention for a batch of (SeqData, context_len, num_query_rows); outputs per sequence.

    The pool places pages in random blocks (seeded), so layouts differ between calls. Its dtype
    is `kv_dtype` (default: the keys' dtype); queries keep the keys' dtype. `precision`: the
    dot products' (ops.paged_attention); `window`: its sliding window (0: full attention).
    """
    from kvrelay.kernels import paged_attention

    g = torch.Generator().manual_seed(seed)
    pages = [-(-ctx // page_size) for _, ctx, _ in specs]
    num_blocks = sum(pages) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(perm[at : at + n])
        at += n
    seq0 = specs[0][0]
    kv_heads, head_dim = seq0.keys.shape[1:]
    # Unused slots hold finite junk: stale data must never leak into results.
    pool = torch.randn(num_blocks, 1, 2, page_size, kv_heads, head_dim, generator=g)
    pool = pool.to(device=device, dtype=kv_dtype or seq0.keys.dtype)
    full = build_meta(tables, [c for _, c, _ in specs], [c for _, c, _ in specs], page_size, device)
    keys = torch.cat([s.keys[:c] for s, c, _ in specs]).to(device)
    values = torch.cat([s.values[:c] for s, c, _ in specs]).to(device)
    write_kv(pool, 0, keys, values, full.slot_mapping)
    meta = build_meta(tables, [c for _, c, _ in specs], [n for _, _, n in specs], page_size, device)
    query = torch.cat([s.queries[c - n : c] for s, c, n in specs]).to(device)
    out = paged_attention(
        query, pool, 0, meta, scale, impl=impl, precision=precision, window=window
    )
    return list(out.cpu().split([n for _, _, n in specs]))
