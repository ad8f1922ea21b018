"""Paged-KV kernels: KV write (optionally fused with RoPE), paged attention (full or with a
sliding window), page gather/scatter (C++ on CPU fp32 when built, torch otherwise on CPU, Triton
on CUDA; Triton is imported lazily, only when a CUDA tensor or impl="triton" is used), and the
decoder's row-wise ops (RMSNorm with the residual add, SiLU * up, GELU-tanh * up, int8 row
quantization: C++ on CPU fp32, Triton for RMSNorm on CUDA, torch elsewhere), the dense linear
layer (a row-invariant Triton GEMM on CUDA, F.linear elsewhere), the int8-weight linear layer,
the Q8_0 x Q8_0 linear layer and the int8-weight x bf16 linear on AMX tiles (C++ only). The C++
kernels come in ISA variants (avx2, avx512, amx), chosen at load time: `loaded_isa()` says
which one runs."""

from kvrelay.kernels.cpu_build import loaded_isa
from kvrelay.kernels.errors import KernelError
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.ops import (
    GGUF_DEQUANT_TYPES,
    Int8Weight,
    Q8Weight,
    W8A16Weight,
    add_rms_norm,
    bf16_attention_available,
    dequantize_gguf,
    gate_up_order,
    gather_pages,
    gelu_tanh_mul,
    int8_linear,
    int8_linear_available,
    linear,
    pack_int8_weight,
    pack_q8_weight,
    pack_w8a16_gate_up,
    pack_w8a16_weight,
    paged_attention,
    q8_linear,
    q8_path,
    quantize_channel_weight,
    quantize_int8_weight,
    quantize_rows,
    rms_norm,
    rope_write_kv,
    sample_rows,
    scatter_pages,
    silu_mul,
    w8a16_available,
    w8a16_linear,
    w8a16_silu_linear,
    write_kv,
)

__all__ = [
    "AttentionMetadata",
    "GGUF_DEQUANT_TYPES",
    "Int8Weight",
    "Q8Weight",
    "W8A16Weight",
    "KernelError",
    "add_rms_norm",
    "bf16_attention_available",
    "dequantize_gguf",
    "gather_pages",
    "gelu_tanh_mul",
    "int8_linear",
    "int8_linear_available",
    "linear",
    "loaded_isa",
    "pack_int8_weight",
    "pack_q8_weight",
    "gate_up_order",
    "pack_w8a16_gate_up",
    "pack_w8a16_weight",
    "paged_attention",
    "q8_linear",
    "q8_path",
    "quantize_channel_weight",
    "quantize_int8_weight",
    "quantize_rows",
    "rms_norm",
    "rope_write_kv",
    "sample_rows",
    "scatter_pages",
    "silu_mul",
    "w8a16_available",
    "w8a16_linear",
    "w8a16_silu_linear",
    "write_kv",
]


def _settle_vml() -> None:
    """torch's float elementwise math on CPU (exp, log, sqrt, tanh, erf, ...) is MKL VML's,
    which picks each function's kernel on its first call in the process; when that first call
    is split across threads, one thread can run a low-accuracy kernel on its whole part
    (measured: 1 fresh 2-thread process in ~10, a relative error of 1.5e-4 on one thread's
    half of the torch attention path's first exp_, later calls right; oneMKL 2024.2,
    pytorch/pytorch#188792). One call on one element (no parallel region) per function and
    dtype settles the choice before anything here runs threaded."""
    import torch

    names = ("exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "tanh", "erf",
             "erfc", "sin", "cos", "tan", "sinh", "cosh", "asin", "acos", "atan")  # fmt: skip
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in names:
            getattr(torch, name)(one)


_settle_vml()
