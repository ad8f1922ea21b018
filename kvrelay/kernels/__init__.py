"""Paged-KV kernels: KV write, paged attention, page gather/scatter (torch on CPU, Triton on
CUDA; Triton is imported lazily, only when a CUDA tensor or impl="triton" is used)."""

from kvrelay.kernels.errors import KernelError
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.ops import gather_pages, paged_attention, scatter_pages, write_kv

__all__ = [
    "AttentionMetadata",
    "KernelError",
    "gather_pages",
    "paged_attention",
    "scatter_pages",
    "write_kv",
]
