"""Triton KV-cache kernels: write new tokens' K/V by slot, gather/scatter whole pages."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.errors import KernelError

COPY_BLOCK = 1024  # elements per program in page copies


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    pool_ptr,
    slots_ptr,
    layer,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sp_b,
    sp_l,
    sp_kv,
    sp_p,
    sp_h,
    KV_HEADS: tl.constexpr,
    HPAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DPAD: tl.constexpr,
    PAGE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    h = tl.arange(0, HPAD)
    d = tl.arange(0, DPAD)
    inside = (h[:, None] < KV_HEADS) & (d[None, :] < HEAD_DIM)
    ok = inside & (tl.full([HPAD, DPAD], 0, tl.int64) + slot >= 0)
    safe = tl.maximum(slot, 0)
    base = (safe // PAGE) * sp_b + layer * sp_l + (safe % PAGE) * sp_p
    dst = base + h[:, None] * sp_h + d[None, :]
    k = tl.load(key_ptr + t * sk_t + h[:, None] * sk_h + d[None, :], mask=ok, other=0.0)
    v = tl.load(value_ptr + t * sv_t + h[:, None] * sv_h + d[None, :], mask=ok, other=0.0)
    tl.store(pool_ptr + dst, k.to(pool_ptr.dtype.element_ty), mask=ok)
    tl.store(pool_ptr + sp_kv + dst, v.to(pool_ptr.dtype.element_ty), mask=ok)


def write_kv(kv_pool, layer, key, value, slot_mapping) -> None:
    """Store each token's K/V at its slot (one program per token); negative slots are skipped."""
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_pool.stride(5) != 1:
        raise KernelError("key, value and kv_pool need a contiguous last dimension")
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    page_size, kv_heads, head_dim = kv_pool.shape[3:]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_pool,
        slot_mapping,
        layer,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_pool.stride(0),
        kv_pool.stride(1),
        kv_pool.stride(2),
        kv_pool.stride(3),
        kv_pool.stride(4),
        KV_HEADS=kv_heads,
        HPAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim,
        DPAD=triton.next_power_of_2(head_dim),
        PAGE=page_size,
    )


@triton.jit
def _copy_pages_kernel(
    src_ptr, dst_ptr, ids_ptr, page_numel, TO_POOL: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    block = tl.load(ids_ptr + i).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < page_numel
    if TO_POOL:
        src = src_ptr + i * page_numel + offs
        dst = dst_ptr + block * page_numel + offs
    else:
        src = src_ptr + block * page_numel + offs
        dst = dst_ptr + i * page_numel + offs
    tl.store(dst, tl.load(src, mask=ok).to(dst_ptr.dtype.element_ty), mask=ok)


def _launch_copy(src, dst, block_ids, to_pool: bool, page_numel: int) -> None:
    n = block_ids.shape[0]
    if n == 0:
        return
    grid = (n, triton.cdiv(page_numel, COPY_BLOCK))
    _copy_pages_kernel[grid](src, dst, block_ids, page_numel, TO_POOL=to_pool, BLOCK=COPY_BLOCK)


def gather_pages(kv_pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Contiguous copy of the pool's blocks block_ids."""
    if not kv_pool.is_contiguous():
        raise KernelError("the Triton page copy needs a contiguous kv_pool")
    out = kv_pool.new_empty((block_ids.shape[0], *kv_pool.shape[1:]))
    _launch_copy(kv_pool, out, block_ids, False, kv_pool[0].numel())
    return out


def scatter_pages(kv_pool: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor) -> None:
    """Copy pages into the pool's blocks block_ids."""
    if not kv_pool.is_contiguous():
        raise KernelError("the Triton page copy needs a contiguous kv_pool")
    _launch_copy(pages.contiguous(), kv_pool, block_ids, True, kv_pool[0].numel())
