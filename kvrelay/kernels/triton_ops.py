"""The Triton backend (imported only for CUDA tensors or impl="triton")."""

from kvrelay.kernels.triton_attention import paged_attention
from kvrelay.kernels.triton_cache import gather_pages, rope_write_kv, scatter_pages, write_kv

__all__ = ["gather_pages", "paged_attention", "rope_write_kv", "scatter_pages", "write_kv"]
