"""Triton paged attention (decode and prefill over a cached prefix, GQA, causal).

A row's softmax is cut into splits of SPLIT_KEYS keys at fixed positions (keys 0..SPLIT_KEYS-1,
then the next SPLIT_KEYS, ...): each split's partial (max m, sum l, weighted values acc) is
computed by an online softmax over its tiles of BLOCK_N keys in order, from scratch, and the
partials are merged in split order. The split size is a constant, never chosen from the batch,
so a row's arithmetic depends on its own context only. Two launches compute exactly that:

- one pass: one program per (sequence, BLOCK_M query tokens, KV head) walks its splits in
  order and merges each into a running total (prefill, and decode of large batches);
- split-K (flash-decoding): one program per (sequence, query block, KV head, split) writes its
  partial to a workspace, and a second kernel merges them in the same order with the same code
  (decode and short query blocks at small batches, where one program per sequence and KV head
  would leave most of the GPU idle at long contexts).

Merging a split no key of which is visible to a row leaves its total exactly unchanged
(scale exp(0) = 1 for the total, exp(-inf) = 0 for the partial), as does a tile fully masked
for a row within a split; so a row's result does not depend on the other rows of its program,
on which masked splits or tiles a launch skips, or on which of the two launches ran: decode
rows equal the matching prefill rows on the same GPU. Multiply-adds are not fused into FMAs
(enable_fp_fusion=False), so the compiler cannot contract the two launches' merges differently.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvrelay.kernels.errors import KernelError
from kvrelay.kernels.metadata import AttentionMetadata

BLOCK_M = 16  # query tokens per program
BLOCK_N = 64  # keys per tile
SPLIT_KEYS = 256  # keys per softmax split: part of every row's arithmetic, never per batch
# The launch: 4 warps, loads double-buffered (2 stages). On an H200 this read 2933 GB/s of KV
# at batch 512 x 8192 tokens (0.69 of its 4264 GB/s device copy), 3 stages 2757 GB/s, 8 warps
# 1747 GB/s (benchmarks/gpu.py). The launch changes no arithmetic: rows are bitwise the same.
NUM_WARPS = 4
NUM_STAGES = 2
# split-K runs while (sequences x query blocks x KV heads) programs would fill fewer than this
# many programs per streaming multiprocessor
SPLIT_BELOW_PER_SM = 4


@triton.jit
def _fresh(ROWS: tl.constexpr, DPAD: tl.constexpr):
    """An online softmax before its first key: (m, l_sum, acc) = (-inf, 0, 0)."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    return m, tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, DPAD], tl.float32)


@triton.jit
def _merge(m, l_sum, acc, m_s, l_s, acc_s):
    """The running total (m, l_sum, acc) with one split's partial merged in."""
    m_new = tl.maximum(m, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m - m_safe)
    b = tl.exp(m_s - m_safe)
    return m_new, l_sum * a + l_s * b, acc * a[:, None] + acc_s * b[:, None]


@triton.jit
def _tile(
    m, l_sum, acc, t, cols, q, pool_ptr, tables_ptr, seq, kvh, layer, window, pos, d, d_ok,
    ctx, sp_b, sp_l, sp_kv, sp_p, sp_h, st_s,
    PAGE: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The online softmax (m, l_sum, acc) advanced over key tile t."""
    kpos = t * BN + cols
    k_ok = kpos < ctx
    block = tl.load(tables_ptr + seq * st_s + kpos // PAGE, mask=k_ok, other=0)
    base = block.to(tl.int64) * sp_b + layer * sp_l + (kpos % PAGE) * sp_p + kvh * sp_h
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(pool_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(pool_ptr + sp_kv + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    visible = (kpos[None, :] <= pos[:, None]) & k_ok[None, :]
    visible = visible & ((window <= 0) | (kpos[None, :] > pos[:, None] - window))
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_sum, acc * alpha[:, None] + pv


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, pool_ptr, tables_ptr, ctx_ptr, qsl_ptr, part_ptr, ml_ptr,
    layer, scale, window, num_heads, num_splits,
    sq_t, sq_h, so_t, so_h, sp_b, sp_l, sp_kv, sp_p, sp_h, st_s,
    GROUP: tl.constexpr, GPAD: tl.constexpr, HEAD_DIM: tl.constexpr, DPAD: tl.constexpr,
    PAGE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLIT_TILES: tl.constexpr,
    SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """SPLIT_K = False: the one-pass launch, grid (sequence, query block, KV head).
    SPLIT_K = True: grid (sequence, query block, KV head x num_splits); a program stores its
    split's partial at [token, head, split] of part (acc) and ml (m, l); splits at or past the
    context store nothing (_merge_splits_kernel does not read them)."""
    seq = tl.program_id(0)
    qblock = tl.program_id(1)
    kvh = tl.program_id(2)
    split = 0
    if SPLIT_K:
        split = kvh % num_splits
        kvh = kvh // num_splits
    q_start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    if (not SPLIT_K) or (split * SPLIT_TILES * BN < ctx):
        rows = tl.arange(0, BM * GPAD)
        tok = qblock * BM + rows // GPAD
        g = rows % GPAD
        row_ok = (tok < n) & (g < GROUP)
        pos = ctx - n + tok
        d = tl.arange(0, DPAD)
        d_ok = d < HEAD_DIM
        head = kvh * GROUP + g
        q_off = (q_start + tok)[:, None] * sq_t + head[:, None] * sq_h + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # bf16/fp16 pools use tensor-core dots with fp32 accumulation; fp32 stays exact ("ieee")
        q = (q.to(tl.float32) * scale).to(pool_ptr.dtype.element_ty)

        last_tok = tl.minimum(n, (qblock + 1) * BM) - 1
        num_tiles = tl.where(qblock * BM < n, (ctx - n + last_tok) // BN + 1, 0)
        # window > 0: the block's first row sees keys from its position - window + 1 on;
        # tiles before that are masked for every row of the block (they change nothing)
        first_tile = tl.where(
            window > 0, tl.maximum(ctx - n + qblock * BM - window + 1, 0) // BN, 0
        )
        if SPLIT_K:
            t_lo = tl.maximum(split * SPLIT_TILES, first_tile)
            t_hi = tl.minimum((split + 1) * SPLIT_TILES, num_tiles)
            m, l_sum, acc = _fresh(BM * GPAD, DPAD)
            cols = tl.arange(0, BN)
            for t in range(t_lo, t_hi):
                m, l_sum, acc = _tile(
                    m, l_sum, acc, t, cols, q, pool_ptr, tables_ptr, seq, kvh, layer, window,
                    pos, d, d_ok, ctx, sp_b, sp_l, sp_kv, sp_p, sp_h, st_s, PAGE, BN, PRECISION,
                )  # fmt: skip
            cell = ((q_start + tok).to(tl.int64) * num_heads + head) * num_splits + split
            tl.store(part_ptr + cell[:, None] * DPAD + d[None, :], acc, mask=row_ok[:, None])
            tl.store(ml_ptr + cell * 2, m, mask=row_ok)
            tl.store(ml_ptr + cell * 2 + 1, l_sum, mask=row_ok)
        else:
            # one pipelined loop over the tiles (a loop per split restarts the pipeline every
            # SPLIT_TILES tiles); the split's partial (m, l_sum, acc) is merged into the total
            # (m_t, l_t, acc_t) where the next split begins and after the last tile
            m_t, l_t, acc_t = _fresh(BM * GPAD, DPAD)
            m, l_sum, acc = _fresh(BM * GPAD, DPAD)
            cols = tl.arange(0, BN)
            for t in range(first_tile, num_tiles):
                if (t % SPLIT_TILES == 0) and (t > first_tile):
                    m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m, l_sum, acc)
                    m, l_sum, acc = _fresh(BM * GPAD, DPAD)
                m, l_sum, acc = _tile(
                    m, l_sum, acc, t, cols, q, pool_ptr, tables_ptr, seq, kvh, layer, window,
                    pos, d, d_ok, ctx, sp_b, sp_l, sp_kv, sp_p, sp_h, st_s, PAGE, BN, PRECISION,
                )  # fmt: skip
            m, l_sum, acc = _merge(m_t, l_t, acc_t, m, l_sum, acc)
            out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
            o_off = (q_start + tok)[:, None] * so_t + head[:, None] * so_h + d[None, :]
            o_mask = row_ok[:, None] & d_ok[None, :]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, ctx_ptr, qsl_ptr, part_ptr, ml_ptr, num_heads, num_splits, so_t, so_h,
    GROUP: tl.constexpr, GPAD: tl.constexpr, HEAD_DIM: tl.constexpr, DPAD: tl.constexpr,
    BM: tl.constexpr, SPLIT_KEYS: tl.constexpr,
):  # fmt: skip
    """The split-K launch's second kernel, grid (sequence, query block, KV head): merges the
    partials of splits 0, 1, ... below the context in order, as the one-pass launch does."""
    seq = tl.program_id(0)
    qblock = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    rows = tl.arange(0, BM * GPAD)
    tok = qblock * BM + rows // GPAD
    g = rows % GPAD
    row_ok = (tok < n) & (g < GROUP)
    d = tl.arange(0, DPAD)
    head = kvh * GROUP + g
    first = ((q_start + tok).to(tl.int64) * num_heads + head) * num_splits
    m, l_sum, acc = _fresh(BM * GPAD, DPAD)
    for sp in range(0, tl.minimum(tl.cdiv(ctx, SPLIT_KEYS), num_splits)):
        cell = first + sp
        m_s = tl.load(ml_ptr + cell * 2, mask=row_ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + cell * 2 + 1, mask=row_ok, other=0.0)
        acc_s = tl.load(part_ptr + cell[:, None] * DPAD + d[None, :], mask=row_ok[:, None],
                        other=0.0)  # fmt: skip
        m, l_sum, acc = _merge(m, l_sum, acc, m_s, l_s, acc_s)
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    o_off = (q_start + tok)[:, None] * so_t + head[:, None] * so_h + d[None, :]
    o_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def use_split_k(query: torch.Tensor, meta: AttentionMetadata, kv_heads: int,
                split_keys: int = SPLIT_KEYS) -> bool:  # fmt: skip
    """Whether the split-K launch runs: on a GPU, for query blocks of one program (decode,
    verifying drafted tokens) whose context spans more than one split, when the one-pass launch
    would give each multiprocessor fewer than SPLIT_BELOW_PER_SM programs. Either launch
    computes the same rows; this only picks the faster."""
    if not query.is_cuda or meta.max_query_len > BLOCK_M or meta.max_context_len <= split_keys:
        return False
    programs = meta.num_seqs * triton.cdiv(max(meta.max_query_len, 1), BLOCK_M) * kv_heads
    return programs < SPLIT_BELOW_PER_SM * _multiprocessors(query.device.index or 0)


def paged_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    block_n: int = BLOCK_N,
    window: int = 0,
    split_k: bool | None = None,
    split_keys: int = SPLIT_KEYS,
) -> torch.Tensor:
    """Paged attention of every query row over its sequence's context.
    window > 0: sliding-window attention (keys p - window < k <= p; the tiles wholly before a
    block's window are not read). split_k: the launch (None: `use_split_k` picks); both give
    the same rows.

    num_warps, num_stages, block_n (keys per tile) and split_keys are for benchmarks/gpu.py's
    sweep; a block_n or split_keys other than the defaults changes the softmax's tiles or
    splits, so results in the last bits."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    page_size, kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    group = num_heads // kv_heads
    if query.stride(2) != 1 or kv_pool.stride(5) != 1:
        raise KernelError("query and kv_pool need a contiguous last dimension")
    if split_keys % block_n:
        raise KernelError(f"split_keys ({split_keys}) must be a multiple of block_n ({block_n})")
    if split_k is None:
        split_k = use_split_k(query, meta, kv_heads, split_keys)
    out = torch.empty_like(query)
    num_seqs = meta.context_lens.shape[0]
    qblocks = triton.cdiv(max(meta.max_query_len, 1), BLOCK_M)
    dpad = max(16, triton.next_power_of_2(head_dim))
    num_splits = triton.cdiv(max(meta.max_context_len, 1), split_keys) if split_k else 1
    part = ml = out  # not read by the one-pass launch
    if split_k:
        tokens = query.shape[0]
        part = torch.empty(tokens, num_heads, num_splits, dpad, dtype=torch.float32,
                           device=query.device)  # fmt: skip
        ml = torch.empty(tokens, num_heads, num_splits, 2, dtype=torch.float32,
                         device=query.device)  # fmt: skip
    shape = dict(GROUP=group, GPAD=triton.next_power_of_2(group), HEAD_DIM=head_dim, DPAD=dpad)
    _paged_attention_kernel[(num_seqs, qblocks, kv_heads * num_splits)](
        query, out, kv_pool, meta.block_tables, meta.context_lens, meta.query_start_loc,
        part, ml, layer, scale, window, num_heads, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *kv_pool.stride()[:5], meta.block_tables.stride(0),
        **shape, PAGE=page_size, BM=BLOCK_M, BN=block_n, SPLIT_TILES=split_keys // block_n,
        SPLIT_K=split_k,
        # fp32 dots must not drop to TF32; for 16-bit inputs the setting does not apply
        PRECISION="ieee" if kv_pool.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
    )  # fmt: skip
    if split_k:
        _merge_splits_kernel[(num_seqs, qblocks, kv_heads)](
            out, meta.context_lens, meta.query_start_loc, part, ml, num_heads, num_splits,
            out.stride(0), out.stride(1), **shape, BM=BLOCK_M, SPLIT_KEYS=split_keys,
            num_warps=num_warps, enable_fp_fusion=False,
        )  # fmt: skip
    return out
