"""Triton paged attention (decode and prefill over a cached prefix, GQA, causal).

One program handles BLOCK_M query tokens x the query heads of one KV head of one sequence, and
walks the sequence's key tiles 0, 1, 2, ... in order with an online softmax. A row's result does
not depend on the other rows of its program: tiles that are fully masked for it leave m, l and
acc exactly unchanged (alpha = exp(0) = 1, p = 0), and the launch configuration is the same for
decode and prefill, so decode rows equal the matching prefill rows on the same GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.errors import KernelError
from kvrelay.kernels.metadata import AttentionMetadata

BLOCK_M = 16  # query tokens per program
BLOCK_N = 64  # keys per tile
# The launch: 4 warps, loads double-buffered (2 stages). On an H200 this read 2933 GB/s of KV
# at batch 512 x 8192 tokens (0.69 of its 4264 GB/s device copy), 3 stages 2757 GB/s, 8 warps
# 1747 GB/s (benchmarks/gpu.py). The launch changes no arithmetic: rows are bitwise the same.
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    out_ptr,
    pool_ptr,
    tables_ptr,
    ctx_ptr,
    qsl_ptr,
    layer,
    scale,
    window,
    sq_t,
    sq_h,
    so_t,
    so_h,
    sp_b,
    sp_l,
    sp_kv,
    sp_p,
    sp_h,
    st_s,
    GROUP: tl.constexpr,
    GPAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DPAD: tl.constexpr,
    PAGE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PRECISION: tl.constexpr,
):
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
    pos = ctx - n + tok
    d = tl.arange(0, DPAD)
    d_ok = d < HEAD_DIM
    head = kvh * GROUP + g
    q_off = (q_start + tok)[:, None] * sq_t + head[:, None] * sq_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    # bf16/fp16 pools use tensor-core dots with fp32 accumulation; fp32 stays exact ("ieee").
    q = (q * scale).to(pool_ptr.dtype.element_ty)

    last_tok = tl.minimum(n, (qblock + 1) * BM) - 1
    num_tiles = tl.where(qblock * BM < n, (ctx - n + last_tok) // BN + 1, 0)
    # window > 0: the block's first row sees keys from its position - window + 1 on; tiles
    # before that are masked for every row of the block (they would leave m, l, acc unchanged)
    first_tile = tl.where(window > 0, tl.maximum(ctx - n + qblock * BM - window + 1, 0) // BN, 0)
    m = tl.full([BM * GPAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([BM * GPAD], tl.float32)
    acc = tl.zeros([BM * GPAD, DPAD], tl.float32)
    cols = tl.arange(0, BN)
    for t in range(first_tile, num_tiles):
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
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    o_off = (q_start + tok)[:, None] * so_t + head[:, None] * so_h + d[None, :]
    tl.store(
        out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :]
    )


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
) -> torch.Tensor:
    """Launch the paged attention kernel; one program per (sequence, query block, KV head).
    window > 0: sliding-window attention (keys p - window < k <= p; the tiles wholly before a
    block's window are not read).

    num_warps, num_stages and block_n (keys per tile) are for benchmarks/gpu.py's sweep; a
    block_n other than BLOCK_N changes the softmax's tiles, so results in the last bits."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    page_size, kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    group = num_heads // kv_heads
    if query.stride(2) != 1 or kv_pool.stride(5) != 1:
        raise KernelError("query and kv_pool need a contiguous last dimension")
    out = torch.empty_like(query)
    num_seqs = meta.context_lens.shape[0]
    grid = (num_seqs, triton.cdiv(max(meta.max_query_len, 1), BLOCK_M), kv_heads)
    _paged_attention_kernel[grid](
        query,
        out,
        kv_pool,
        meta.block_tables,
        meta.context_lens,
        meta.query_start_loc,
        layer,
        scale,
        window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_pool.stride(0),
        kv_pool.stride(1),
        kv_pool.stride(2),
        kv_pool.stride(3),
        kv_pool.stride(4),
        meta.block_tables.stride(0),
        GROUP=group,
        GPAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        DPAD=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page_size,
        BM=BLOCK_M,
        BN=block_n,
        # fp32 dots must not drop to TF32; for 16-bit inputs the setting does not apply.
        PRECISION="ieee" if kv_pool.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
