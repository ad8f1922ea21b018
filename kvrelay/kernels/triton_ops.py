"""The Triton backend (imported only for CUDA tensors or impl="triton")."""

from kvrelay.kernels.triton_attention import paged_attention
from kvrelay.kernels.triton_cache import gather_pages, scatter_pages, write_kv
from kvrelay.kernels.triton_linear import linear
from kvrelay.kernels.triton_rows import add_rms_norm, rms_norm

__all__ = [
    "add_rms_norm",
    "gather_pages",
    "linear",
    "paged_attention",
    "rms_norm",
    "scatter_pages",
    "write_kv",
]
