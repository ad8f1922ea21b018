"""The C++ CPU path (fp32 compute, AVX2 or AVX-512; the KV pool fp32, bf16 or fp16): paged
attention reading pages in place, KV writes.

The pool may hold fp32, bf16 or fp16 (KV_DTYPES): loads widen to fp32 exactly and writes round
to nearest even like `.to(pool.dtype)`. Shapes the extension does not cover (other dtypes,
head_dim not in HEAD_DIMS, pages over 256 keys, non-CPU tensors) go to the torch path, which
stays the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kernels import cpu_build, torch_paged, torch_ref
from kvrelay.kernels.errors import KernelError
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.torch_ref import gather_pages, scatter_pages

__all__ = [
    "bf16_attention_available",
    "gather_pages",
    "paged_attention",
    "rope_write_kv",
    "scatter_pages",
    "write_kv",
]

CHUNK_KEYS = 256  # keys per chunk: the unit of parallel work and of the final merge
HEAD_DIMS = (8, 16, 32, 64, 128, 256)
BF16_HEAD_DIMS = (32, 64, 128, 256)  # bf16 attention: whole 32-dim tiles, up to 8 of them
MAX_PAGE_SIZE = 256
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(slots=True)
class CppPlan:
    """The extension's work items for one step's metadata (shared by all layers)."""

    block_tables: torch.Tensor  # int32 [S, max_blocks], contiguous
    items: torch.Tensor  # int32 [N, 3]: chunk, first entry, end entry
    entries: torch.Tensor  # int32 [M, 4]: sequence, first token, positions, first position
    positions: torch.Tensor  # int32 [T]
    chunk_offsets: torch.Tensor  # int32 [T + 1]: first partial of each token
    chunk_pages: int
    window: int = 0  # the attention window the plan is for (0: full attention)

    def args(self) -> tuple:
        """The plan as the extension's attention calls take it, in their order."""
        return (
            self.block_tables,
            self.items,
            self.entries,
            self.positions,
            self.chunk_offsets,
            self.chunk_pages,
        )


# is_cpu rather than device.type in these per-call checks: a device object costs ~0.3 us.
def _f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors)


def _pool_ok(kv_pool: torch.Tensor) -> bool:
    """A contiguous CPU pool of an element type the extension reads and writes."""
    return kv_pool.dtype in KV_DTYPES and kv_pool.is_cpu and kv_pool.is_contiguous()


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each token's [H, D] contiguous (a view of a fused QKV row is fine)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def write_kv(
    kv_pool: torch.Tensor,
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V to its slot (negative slots skipped); bitwise the torch result."""
    ext = cpu_build.load()
    if ext is None or not _f32_cpu(key, value) or not _pool_ok(kv_pool):
        torch_ref.write_kv(kv_pool, layer, key, value, slot_mapping)
        return
    ext.write_kv(
        kv_pool, layer, _rows_contiguous(key), _rows_contiguous(value), slot_mapping.contiguous()
    )


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
    """RoPE on q and k of a fused QKV [T, (heads + 2 kv_heads) * D]; k and v go to the pool."""
    ext = cpu_build.load()
    if ext is None or not _f32_cpu(qkv, cos, sin) or not _pool_ok(kv_pool):
        return torch_ref.rope_write_kv(
            qkv, positions, cos, sin, kv_pool, layer, slot_mapping, num_heads
        )
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    return ext.rope_write_kv(
        qkv,
        positions.to(torch.int64).contiguous(),
        cos.contiguous(),
        sin.contiguous(),
        kv_pool,
        layer,
        slot_mapping.contiguous(),
        num_heads,
    )


def supports(query: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """True when the extension can run this attention call."""
    return (
        query.dtype == torch.float32
        and query.is_cpu
        and _pool_ok(kv_pool)
        and query.shape[2] in HEAD_DIMS
        and kv_pool.shape[3] <= MAX_PAGE_SIZE
    )


def get_plan(
    meta: AttentionMetadata, page_size: int, num_blocks: int, num_tokens: int, window: int = 0
) -> CppPlan:
    """The cached plan for this metadata and attention window (built on the first call of a
    layer with that window)."""
    key = ("cpp", page_size, num_blocks, num_tokens, window)
    plan = meta.plans.get(key)
    if plan is None:
        plan = _build_plan(meta, page_size, num_blocks, num_tokens, window)
        meta.plans[key] = plan
    return plan


def _build_plan(
    meta: AttentionMetadata, page_size: int, num_blocks: int, num_tokens: int, window: int
) -> CppPlan:
    ext = cpu_build.load()
    if ext is None:  # paged_attention plans only when the extension loaded
        raise KernelError("the C++ CPU kernels are not loaded")
    chunk_pages = max(1, CHUNK_KEYS // page_size)
    tables = meta.block_tables.to("cpu", torch.int32).contiguous()
    if tables.dim() != 2:
        raise KernelError(f"block_tables must be 2-D, got {tuple(tables.shape)}")
    try:
        items, entries, positions, offsets = ext.build_plan(
            tables,
            meta.context_lens.to("cpu", torch.int32).contiguous(),
            meta.query_start_loc.to("cpu", torch.int32).contiguous(),
            num_tokens,
            page_size,
            chunk_pages,
            num_blocks,
            window,
        )
    except ValueError as exc:
        raise KernelError(str(exc)) from None
    return CppPlan(tables, items, entries, positions, offsets, chunk_pages, window)


def bf16_attention_available() -> bool:
    """Whether `paged_attention(..., precision="bf16")` runs here: the amx build loaded and the
    OS grants its tiles."""
    ext = cpu_build.load()
    return ext is not None and bool(ext.bf16_attention_available())


def paged_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    precision: str = "fp32",
    window: int = 0,
) -> torch.Tensor:
    """Causal paged attention, bitwise independent of batch, chunking and thread count.
    `precision="bf16"`: q.k and p.v on AMX-BF16 tiles (docs/internals.md), a bf16 pool only;
    a KernelError where it cannot run (no other path gives its bits). window > 0: sliding-window
    attention (keys p - window < k <= p; pages wholly before a row block's window not read)."""
    ext = cpu_build.load()
    bf16 = precision == "bf16"
    if bf16:
        if ext is None or not ext.bf16_attention_available():
            raise KernelError(
                "bf16 attention needs the C++ kernels' amx build (AMX-BF16, tiles granted by "
                "the OS)"
            )
        if (
            not supports(query, kv_pool)
            or kv_pool.dtype != torch.bfloat16
            or kv_pool.shape[3] % 16
            or query.shape[2] not in BF16_HEAD_DIMS
        ):
            raise KernelError(
                "bf16 attention needs fp32 queries on CPU, a bfloat16 KV pool, a page size "
                "that is a multiple of 16 and head_dim 32, 64, 128 or 256 (got "
                f"{query.dtype} queries on {query.device}, a {kv_pool.dtype} pool, page size "
                f"{kv_pool.shape[3]}, head_dim {query.shape[2]})"
            )
    elif ext is None or not supports(query, kv_pool):
        return torch_paged.paged_attention(query, kv_pool, layer, meta, scale, window)
    assert ext is not None
    shape = kv_pool.shape
    plan = get_plan(meta, shape[3], shape[0], query.shape[0], window)
    return ext.paged_attention(
        query.contiguous(), kv_pool, layer, *plan.args(), scale, bf16, window
    )
