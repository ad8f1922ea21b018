"""Paged-KV kernels: KV write (optionally fused with RoPE), paged attention, page gather/scatter
(C++ on CPU fp32 when built, torch otherwise on CPU, Triton on CUDA; Triton is imported lazily,
only when a CUDA tensor or impl="triton" is used)."""

from kvrelay.kernels.errors import KernelError
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.ops import (
    gather_pages,
    paged_attention,
    rope_write_kv,
    scatter_pages,
    write_kv,
)

__all__ = [
    "AttentionMetadata",
    "KernelError",
    "gather_pages",
    "paged_attention",
    "rope_write_kv",
    "scatter_pages",
    "write_kv",
]
