"""Public kernel ops: validate arguments, then dispatch to Triton (CUDA), C++ (CPU fp32), torch.

The dispatch follows the compute dtype (query, key/value, qkv), never the pool's: an fp32 model
runs the C++ kernels on an fp32, bf16 or fp16 pool alike.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kvrelay.kernels.errors import KernelError
from kvrelay.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

_IMPLS = ("auto", "torch", "triton", "cpp")
# attention dot products: fp32, or q and p rounded to bf16 on AMX tiles
PRECISIONS = ("fp32", "bf16")
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_WINDOW = 2**31 - 1  # larger attention windows act as this one (int32 in the kernels)


def _backend(impl: str, tensor: torch.Tensor) -> ModuleType:
    """The module implementing the op; Triton is imported only when it is used."""
    triton_ops = _triton_backend(impl, tensor)
    if triton_ops is not None:
        return triton_ops
    if impl == "cpp" or (impl == "auto" and tensor.dtype == torch.float32):
        from kvrelay.kernels import cpu_build

        # is_cpu, not device.type: it runs per layer call, and device objects cost ~0.3 us each
        if tensor.is_cpu and cpu_build.load() is not None:
            from kvrelay.kernels import cpu_paged

            return cpu_paged
        if impl == "cpp":
            raise KernelError("impl='cpp' needs CPU tensors and the built C++ CPU kernels")
    if not tensor.is_cpu:
        # The invariant torch path is tuned for CPU; elsewhere the simple reference runs.
        from kvrelay.kernels import torch_ref

        return torch_ref
    from kvrelay.kernels import torch_paged

    return torch_paged


def _check_pool(kv_pool: torch.Tensor, layer: int) -> None:
    if kv_pool.dim() != 6 or kv_pool.shape[2] != 2:
        raise KernelError(
            "kv_pool must be [num_blocks, num_layers, 2, page_size, kv_heads, head_dim], "
            f"got {tuple(kv_pool.shape)}"
        )
    if not 0 <= layer < kv_pool.shape[1]:
        raise KernelError(f"layer {layer} out of range for {kv_pool.shape[1]} layers")
    if kv_pool.dtype not in KV_DTYPES:
        raise KernelError(
            f"kv_pool dtype must be float32, bfloat16 or float16, got {kv_pool.dtype}"
        )


def write_kv(
    kv_pool: torch.Tensor,
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: str = "auto",
) -> None:
    """Write key/value [T, kv_heads, head_dim] into the pool at slot_mapping; skip slots < 0."""
    _check_pool(kv_pool, layer)
    want = (slot_mapping.shape[0], *kv_pool.shape[4:])
    if tuple(key.shape) != want or tuple(value.shape) != want:
        raise KernelError(
            f"key/value must be {want}, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.dtype != torch.int64:
        raise KernelError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    num_slots = kv_pool.shape[0] * kv_pool.shape[3]
    if not slot_mapping.is_cuda and slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
        raise KernelError(f"slot {int(slot_mapping.max())} outside the pool's {num_slots} slots")
    _backend(impl, key).write_kv(kv_pool, layer, key, value, slot_mapping)


def check_rope_rows(
    positions: torch.Tensor, slot_mapping: torch.Tensor, table_rows: int, kv_pool: torch.Tensor
) -> None:
    """Positions inside the RoPE tables and slots inside the pool (CPU rows: on CUDA these
    reductions would cost a device sync), else a KernelError."""
    if not 0 <= int(positions.min()) <= int(positions.max()) < table_rows:
        raise KernelError(f"positions must be in [0, {table_rows})")
    if int(slot_mapping.max()) >= kv_pool.shape[0] * kv_pool.shape[3]:
        raise KernelError(f"slot {int(slot_mapping.max())} outside the pool")


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    num_heads: int,
    impl: str = "auto",
) -> torch.Tensor:
    """RoPE (rotate_half) on q and k of qkv [T, (heads + 2 kv_heads) * D] at positions [T]
    with cos/sin tables [N, D/2]; k and v are written at slot_mapping; returns q [T, heads, D].
    """
    _check_pool(kv_pool, layer)
    kv_heads, head_dim = kv_pool.shape[4:]
    num_tokens = slot_mapping.shape[0]
    width = (num_heads + 2 * kv_heads) * head_dim
    if qkv.dim() != 2 or tuple(qkv.shape) != (num_tokens, width):
        raise KernelError(f"qkv must be [{num_tokens}, {width}], got {tuple(qkv.shape)}")
    if positions.shape != slot_mapping.shape or slot_mapping.dtype != torch.int64:
        raise KernelError("positions and slot_mapping must both be [T]; slot_mapping int64")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim // 2:
        raise KernelError(f"cos/sin must be [N, {head_dim // 2}], got {tuple(cos.shape)}")
    if not qkv.is_cuda and num_tokens:
        check_rope_rows(positions, slot_mapping, cos.shape[0], kv_pool)
    backend = _backend(impl, qkv)
    fused = getattr(backend, "rope_write_kv", None)
    if fused is not None:
        return fused(qkv, positions, cos, sin, kv_pool, layer, slot_mapping, num_heads)
    # RoPE in torch (elementwise, no host sync: a CUDA graph can hold it), K/V through the
    # backend's own write
    from kvrelay.kernels.torch_ref import rotate

    out, v = rotate(qkv, positions, cos, sin, num_heads, kv_heads)
    backend.write_kv(kv_pool, layer, out[:, num_heads:], v, slot_mapping)
    return out[:, :num_heads]


def paged_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    impl: str = "auto",
    precision: str | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal paged attention for query [T, heads, head_dim]; returns [T, heads, head_dim].
    `precision` (None: `meta.precision`): "fp32" (every path) or "bf16" (q and p rounded to
    bf16 for the dot products, on AMX tiles: the C++ amx build only,
    `bf16_attention_available()`; a KernelError elsewhere). `window` W > 0: sliding-window
    attention, the query at position p sees the keys at positions p - W < k <= p (W keys with
    its own; transformers' `kv_idx > q_idx - sliding_window`), and the C++ path does not read
    the pages wholly before that; 0: full causal attention. A window covering the whole context
    gives bitwise the full attention's rows."""
    precision = precision or meta.precision
    try:
        window = operator.index(window)
    except TypeError:
        raise KernelError(f"window must be an int, got {window!r}") from None
    if window < 0:
        raise KernelError(f"window must be >= 0 (0: full attention), got {window}")
    window = min(window, MAX_WINDOW)  # any window over the context is full attention
    if precision not in PRECISIONS:
        raise KernelError(f"attention precision must be one of {PRECISIONS}, got {precision!r}")
    _check_pool(kv_pool, layer)
    if query.dim() != 3 or query.shape[2] != kv_pool.shape[5]:
        raise KernelError(f"query must be [T, heads, {kv_pool.shape[5]}], got {tuple(query.shape)}")
    if query.shape[1] % kv_pool.shape[4]:
        raise KernelError(
            f"query heads {query.shape[1]} not a multiple of kv heads {kv_pool.shape[4]}"
        )
    num_seqs = meta.context_lens.shape[0]
    if meta.query_start_loc.shape[0] != num_seqs + 1 or meta.block_tables.shape[0] != num_seqs:
        raise KernelError("query_start_loc must have S+1 entries and block_tables S rows")
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if precision == "bf16":
        from kvrelay.kernels import cpu_paged

        return cpu_paged.paged_attention(query, kv_pool, layer, meta, scale, "bf16", window)
    return _backend(impl, query).paged_attention(query, kv_pool, layer, meta, scale, window=window)


def bf16_attention_available() -> bool:
    """Whether paged_attention(..., precision="bf16") runs on this host (AMX-BF16)."""
    from kvrelay.kernels import cpu_paged

    return cpu_paged.bf16_attention_available()


def gather_pages(
    kv_pool: torch.Tensor, block_ids: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """Contiguous copy [n, L, 2, P, H, D] of the blocks block_ids."""
    _check_pool(kv_pool, 0)
    if block_ids.dim() != 1:
        raise KernelError(f"block_ids must be 1-D, got {tuple(block_ids.shape)}")
    return _backend(impl, kv_pool).gather_pages(kv_pool, block_ids)


def scatter_pages(
    kv_pool: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor, impl: str = "auto"
) -> None:
    """Copy pages [n, L, 2, P, H, D] into the blocks block_ids."""
    _check_pool(kv_pool, 0)
    if block_ids.dim() != 1 or tuple(pages.shape) != (block_ids.shape[0], *kv_pool.shape[1:]):
        raise KernelError(
            f"pages must be [{block_ids.shape[0]}, *{tuple(kv_pool.shape[1:])}], "
            f"got {tuple(pages.shape)}"
        )
    _backend(impl, kv_pool).scatter_pages(kv_pool, block_ids, pages)


def _cpp_rows(*tensors: torch.Tensor) -> ModuleType | None:
    """The C++ extension when every tensor is a CPU fp32 tensor it can take, else None."""
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.stride(-1) != 1:
            return None
    from kvrelay.kernels import cpu_build

    return cpu_build.load()


def _triton_backend(impl: str, tensor: torch.Tensor) -> ModuleType | None:
    """The Triton backend for CUDA tensors or impl="triton" (every op's first choice), else
    None; a bad `impl` raises."""
    if impl not in _IMPLS:
        raise KernelError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "triton" or (impl == "auto" and tensor.is_cuda):
        from kvrelay.kernels import triton_ops

        return triton_ops
    return None


def _cpp_or_torch(impl: str, *tensors: torch.Tensor) -> ModuleType | None:
    """The C++ extension for impl "auto"/"cpp" where it takes the tensors, else None (torch)."""
    ext = None if impl == "torch" else _cpp_rows(*tensors)
    if ext is None and impl == "cpp":
        raise KernelError("impl='cpp' needs CPU fp32 rows and the built C++ CPU kernels")
    return ext


def _rows_2d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    """RMSNorm of each row of x [T, D] (a new tensor)."""
    triton_ops = _triton_backend(impl, x)
    if triton_ops is not None:
        return triton_ops.rms_norm(_rows_2d(x), weight, eps).view(x.shape)
    ext = _cpp_or_torch(impl, x, weight)
    if ext is None:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return ext.rms_norm(x, weight.contiguous(), eps)


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    impl: str = "auto",
) -> torch.Tensor:
    """residual += delta (in place), then RMSNorm of each row of the sum (a new tensor)."""
    if residual.shape != delta.shape:
        raise KernelError(f"delta {tuple(delta.shape)} must match {tuple(residual.shape)}")
    triton_ops = _triton_backend(impl, residual)
    if triton_ops is not None:
        if residual.dim() != 2 and not residual.is_contiguous():
            raise KernelError("the Triton add_rms_norm needs a 2-D or contiguous residual")
        rows = residual.view(-1, residual.shape[-1])
        return triton_ops.add_rms_norm(rows, _rows_2d(delta), weight, eps).view(residual.shape)
    ext = _cpp_or_torch(impl, residual, delta, weight)
    if ext is None or not residual.is_contiguous():
        residual.add_(delta)
        return F.rms_norm(residual, (residual.shape[-1],), weight, eps)
    return ext.add_rms_norm(residual, delta, weight.contiguous(), eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for rows [gate | up] of gate_up [T, 2I]; returns [T, I]."""
    ext = _cpp_rows(gate_up)
    if ext is None:
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :half]) * gate_up[:, half:]
    return ext.silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up for rows [gate | up] of gate_up [T, 2I]; returns
    [T, I] (GeGLU: Gemma). gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))),
    `F.gelu(x, approximate="tanh")`; the C++ path (CPU fp32) computes each element on its own,
    the same bits in any batch, thread count and ISA variant, within a few ulp of torch's."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise KernelError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    ext = _cpp_rows(gate_up)
    if ext is None:
        half = gate_up.shape[-1] // 2
        return F.gelu(gate_up[:, :half], approximate="tanh") * gate_up[:, half:]
    return ext.gelu_tanh_mul(gate_up)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, impl: str = "auto"
) -> torch.Tensor:
    """x [..., K] . weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype.

    On CUDA (or impl="triton") a Triton GEMM with one tile configuration for every row count,
    so a row's result is bitwise the same in any batch (cuBLAS's is not); F.linear elsewhere."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise KernelError(
            f"need x [..., K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    triton_ops = _triton_backend(impl, x)
    if triton_ops is not None:
        out = triton_ops.linear(_rows_2d(x), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    if impl == "cpp":
        raise KernelError("linear has no C++ path: impl must be auto, torch or triton")
    return F.linear(x, weight, bias)


def quantize_rows(x: torch.Tensor, qmax: int, zero_point: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 q, fp32 scale [T, 1]): scale = max|row| / qmax, q = round(x / scale) + zero_point.
    Round half to even, like torch.round: both paths give the same bits."""
    ext = _cpp_rows(x)
    if ext is None:
        scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).div_(qmax)
        return torch.round(x / scale).add_(zero_point).to(torch.uint8), scale
    return tuple(ext.quantize_rows(x, float(qmax), zero_point))


INT8_GROUP = 64  # output columns per packed group of `int8_linear`'s layout
INT8_SCALE_BLOCK = 32  # consecutive inputs (k) sharing one scale, like llama.cpp's Q8_0


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A weight [out_features, in_features] packed for `int8_linear`."""

    packed: torch.Tensor  # int8 [ceil(N / 64), K, 64]
    scales: torch.Tensor  # fp32 [ceil(N / 64), ceil(K / 32), 64]
    out_features: int
    in_features: int


def _weight_quant_ext(w: torch.Tensor) -> ModuleType | None:
    """The C++ extension for quantizing the fp32 weight w (on the CPU, 2-D, not empty), else
    None (the torch code runs)."""
    if not w.is_cpu or w.dim() != 2 or w.numel() == 0:
        return None
    from kvrelay.kernels import cpu_build

    return cpu_build.load()


def quantize_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 q [N, K], fp32 scales [N, ceil(K / 32)]): symmetric, one scale per 32 inputs of
    each output, scale = max(max |w|, 1e-12) / 127, q = round(w / scale) in [-127, 127] (half to
    even). The C++ kernel (CPU weights, the extension loaded) gives the torch code's bits; a
    block holding inf gets the scale inf, one holding NaN a NaN scale, their q are all 0."""
    w = weight.detach().float()
    ext = _weight_quant_ext(w)
    if ext is not None:
        q, scales = ext.quantize_int8_weight(w.contiguous())
        return q, scales
    return _quantize_int8_weight_torch(w)


def _quantize_int8_weight_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int8_weight` in torch (the reference of the C++ kernel)."""
    w = weight.detach().float()
    n, k = w.shape
    blocks = -(-k // INT8_SCALE_BLOCK)
    padded = torch.zeros(n, blocks * INT8_SCALE_BLOCK)
    padded[:, :k] = w
    grouped = padded.view(n, blocks, INT8_SCALE_BLOCK)
    scales = grouped.abs().amax(dim=2).clamp_min(1e-12) / 127
    q = torch.round(grouped / scales[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, -1)[:, :k].contiguous(), scales


def _pack_columns(t: torch.Tensor) -> torch.Tensor:
    n, k = t.shape
    groups = -(-n // INT8_GROUP)
    padded = torch.zeros(groups * INT8_GROUP, k, dtype=t.dtype)
    padded[:n] = t
    return padded.view(groups, INT8_GROUP, k).transpose(1, 2).contiguous()


def _check_int8_weight(q: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int]:
    """(N, K, scale blocks) of `quantize_int8_weight`'s (q, scales); KernelError otherwise."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise KernelError(f"need a 2-D int8 weight, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    blocks = -(-k // INT8_SCALE_BLOCK)
    if tuple(scales.shape) != (n, blocks):
        raise KernelError(f"scales {tuple(scales.shape)} do not fit a weight {tuple(q.shape)}")
    return n, k, blocks


def pack_int8_weight(q: torch.Tensor, scales: torch.Tensor) -> Int8Weight:
    """`quantize_int8_weight`'s (q, scales) in `int8_linear`'s layout (zero columns pad N)."""
    n, k, _ = _check_int8_weight(q, scales)
    return Int8Weight(_pack_columns(q), _pack_columns(scales.float()), n, k)


@dataclass(frozen=True, slots=True)
class Q8Weight:
    """A weight [out_features, in_features] packed for `q8_linear` (llama.cpp's Q8_0 blocks)."""

    packed: torch.Tensor  # int8 [ceil(N / 64), Kp / 4, 64, 4], Kp = K rounded up to 32
    scales: torch.Tensor  # fp32 [ceil(N / 64), Kp / 32, 64]
    comp: torch.Tensor  # int32 [ceil(N / 64), Kp / 32, 64]: 128 * each block's weight sum
    out_features: int
    in_features: int


def pack_q8_weight(q: torch.Tensor, scales: torch.Tensor) -> Q8Weight:
    """`quantize_int8_weight`'s (q, scales) in `q8_linear`'s layout: per group of 64 outputs,
    each 4 consecutive inputs of every output side by side (an AMX B-tile row, a VNNI lane)."""
    n, k, blocks = _check_int8_weight(q, scales)
    if int(q.min()) < -127:
        raise KernelError("q8 weights must lie in [-127, 127]")
    groups = -(-n // INT8_GROUP)
    padded = torch.zeros(groups * INT8_GROUP, blocks * INT8_SCALE_BLOCK, dtype=torch.int8)
    padded[:n, :k] = q
    packed = padded.view(groups, INT8_GROUP, blocks * INT8_SCALE_BLOCK // 4, 4)
    packed = packed.permute(0, 2, 1, 3).contiguous()
    sums = (padded.view(-1, blocks, INT8_SCALE_BLOCK).sum(dim=2, dtype=torch.int32) * 128).int()
    comp = sums.view(groups, INT8_GROUP, blocks).transpose(1, 2).contiguous()
    return Q8Weight(packed, _pack_columns(scales.float()), comp, n, k)


def q8_path(rows: int) -> str | None:
    """The code path `q8_linear` takes for `rows` rows ("amx", "vnni", "avx512bw", "avx2";
    None without the C++ kernels). Every path gives the same bits."""
    from kvrelay.kernels import cpu_build

    ext = cpu_build.load()
    return None if ext is None else str(ext.q8_path(rows))


def q8_linear(x: torch.Tensor, weight: Q8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] . W^T (+ bias) in llama.cpp's Q8_0 x Q8_0 arithmetic: each row of x quantized
    to int8 with one scale per 32 inputs, exact integer block dots, one fp32 FMA per block.

    A row's result is the same in any batch, with any thread count and on every ISA variant
    (AMX tiles, VNNI, AVX-512, AVX2: the integer sums are exact). C++ only, like
    `int8_linear`."""
    ext = _linear_rows("q8_linear", x, weight.in_features)
    return ext.q8_linear(
        x.contiguous(), weight.packed, weight.scales, weight.comp, bias, weight.out_features
    )


W8A16_COLS = 32  # output columns per packed block of `w8a16_linear`'s layout (two AMX B tiles)
W8A16_K = 32  # inputs per k tile (16 bf16 pairs)


@dataclass(frozen=True, slots=True)
class W8A16Weight:
    """A weight [out_features, in_features] packed for `w8a16_linear`: int8, one scale per
    output."""

    packed: torch.Tensor  # int8 [ceil(N / 32), Kp / 32, 2, 16, 16, 2], Kp = K rounded up to 32
    scales: torch.Tensor  # fp32 [N]
    out_features: int
    in_features: int


def quantize_channel_weight(
    weight: torch.Tensor, qmax: int = 127
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 q [N, K], fp32 scales [N]): symmetric, one scale per output (its largest
    |w| / qmax, at least 1e-12 / qmax), q = round(w / scale) in [-qmax, qmax] (half to even).
    The C++ kernel (CPU weights, qmax in [1, 127], the extension loaded) gives the torch
    code's bits; a row holding inf gets the scale inf, one holding NaN a NaN scale, their q
    are all 0."""
    w = weight.detach().float()
    ext = _weight_quant_ext(w)
    if ext is not None and isinstance(qmax, int) and 1 <= qmax <= 127:
        q, scales = ext.quantize_channel_weight(w.contiguous(), qmax)
        return q, scales
    return _quantize_channel_weight_torch(w, qmax)


def _quantize_channel_weight_torch(
    weight: torch.Tensor, qmax: int = 127
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_channel_weight` in torch (the reference of the C++ kernel)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / qmax
    return torch.round(w / scales[:, None]).clamp_(-qmax, qmax).to(torch.int8), scales


def pack_w8a16_weight(q: torch.Tensor, scales: torch.Tensor) -> W8A16Weight:
    """`quantize_channel_weight`'s (q, scales) in `w8a16_linear`'s layout: per block of 32
    outputs and k tile of 32 inputs, two AMX B tiles (16 outputs each) of input pairs."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise KernelError(f"need a 2-D int8 weight, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if tuple(scales.shape) != (n,):
        raise KernelError(f"scales {tuple(scales.shape)} do not fit a weight {tuple(q.shape)}")
    if n and int(q.min()) < -127:
        raise KernelError("w8a16 weights must lie in [-127, 127]")
    blocks, ktiles = -(-n // W8A16_COLS), -(-k // W8A16_K)
    padded = torch.zeros(blocks * W8A16_COLS, ktiles * W8A16_K, dtype=torch.int8)
    padded[:n, :k] = q
    # [block, sub, col, ktile, pair, 2] -> [block, ktile, sub, pair, col, 2]
    grid = padded.view(blocks, 2, 16, ktiles, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return W8A16Weight(grid.contiguous(), scales.float().contiguous(), n, k)


def gate_up_order(intermediate: int) -> torch.Tensor:
    """Row order of a [gate; up] weight [2I, K] for `pack_w8a16_gate_up`: per 16 outputs, the
    gate rows then the same up rows (I a multiple of 16)."""
    if intermediate <= 0 or intermediate % 16:
        raise KernelError(f"gate/up fusion needs a multiple of 16 outputs, got {intermediate}")
    gate = torch.arange(intermediate).view(-1, 1, 16)
    return torch.cat([gate, gate + intermediate], dim=1).reshape(-1)


def pack_w8a16_gate_up(q: torch.Tensor, scales: torch.Tensor) -> W8A16Weight:
    """A SwiGLU gate/up weight (q [2I, K] = [gate; up], `quantize_channel_weight`'s scales) for
    `w8a16_silu_linear`: rows in `gate_up_order`, so each 32-column block holds 16 gates and
    their ups."""
    if q.dim() != 2 or q.shape[0] % 2:
        raise KernelError(f"need a [2I, K] gate/up weight, got {tuple(q.shape)}")
    order = gate_up_order(q.shape[0] // 2)
    if tuple(scales.shape) != (q.shape[0],):
        raise KernelError(f"scales {tuple(scales.shape)} do not fit a weight {tuple(q.shape)}")
    return pack_w8a16_weight(q[order], scales[order])


def w8a16_available() -> bool:
    """Whether `w8a16_linear` runs here: the amx kernel variant loaded and the OS grants its
    tiles (AMX-BF16 and AVX512-BF16 hosts)."""
    from kvrelay.kernels import cpu_build

    ext = cpu_build.load()
    return ext is not None and bool(ext.w8a16_available())


def w8a16_linear(x: torch.Tensor, weight: W8A16Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] . (q * scales)^T (+ bias) on AMX bf16 tiles: x rounded to bf16 (nearest even),
    the int8 weights exact in bf16, fp32 sums over K in tiles, each output times its column's
    scale. A row's result is the same in any batch and with any thread count. AMX hosts only
    (`w8a16_available`)."""
    ext = _linear_rows("w8a16_linear", x, weight.in_features)
    if not ext.w8a16_available():
        raise KernelError("w8a16_linear needs AMX-BF16 tiles (the amx kernel variant)")
    return ext.w8a16_linear(x.contiguous(), weight.packed, weight.scales, bias, weight.out_features)


def w8a16_silu_linear(
    x: torch.Tensor, weight: W8A16Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """SiLU(gate) * up [T, I] of x [T, K]'s SwiGLU gate/up projection, weight packed by
    `pack_w8a16_gate_up` (bias, if any, in `gate_up_order`): bitwise `silu_mul` of
    `w8a16_linear` on the unpermuted weight, without the [T, 2I] intermediate."""
    ext = _linear_rows("w8a16_silu_linear", x, weight.in_features)
    if not ext.w8a16_available():
        raise KernelError("w8a16_silu_linear needs AMX-BF16 tiles (the amx kernel variant)")
    if weight.out_features % 32:
        raise KernelError(f"not a gate/up weight of 16 + 16 column blocks: {weight.out_features}")
    return ext.w8a16_silu_linear(
        x.contiguous(), weight.packed, weight.scales, bias, weight.out_features
    )


def _linear_rows(op: str, x: torch.Tensor, in_features: int) -> ModuleType:
    """The C++ extension for `op` on rows x [T, in_features] (CPU fp32); KernelError otherwise."""
    ext = _cpp_rows(x)
    if ext is None or x.dim() != 2 or x.shape[1] != in_features:
        raise KernelError(
            f"{op} needs the C++ kernels and CPU fp32 rows of {in_features} "
            f"features, got {x.dtype} {tuple(x.shape)} on {x.device.type}"
        )
    return ext


def int8_linear_available() -> bool:
    """True where the C++ kernel behind `int8_linear` is built (x86-64 with AVX2 and FMA)."""
    from kvrelay.kernels import cpu_build

    return cpu_build.load() is not None


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] . W^T (+ bias) with W = q * scale from `pack_int8_weight` (fp32 math).

    Each output is one fp32 accumulator over k = 0..K-1 in order, so a row's result is the
    same in any batch and with any thread count. C++ only: there is no torch path with the
    same arithmetic, callers check `int8_linear_available()`."""
    ext = _linear_rows("int8_linear", x, weight.in_features)
    return ext.int8_linear(x.contiguous(), weight.packed, weight.scales, bias, weight.out_features)


def sample_rows(
    logits: torch.Tensor, settings: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor | None:
    """The token drawn for each row of logits [R, V] (C++, csrc/sampling.cpp): settings [R, 4]
    fp32 (temperature > 0, top_p, min_p, u), top_k [R] int64 (0: none); None where the C++
    kernels are not built (the caller samples in torch)."""
    ext = _cpp_rows(logits)
    if ext is None:
        return None
    if (
        logits.dim() != 2
        or settings.shape != (logits.shape[0], 4)
        or top_k.shape != (logits.shape[0],)
    ):
        raise KernelError(
            f"need logits [R, V], settings [R, 4] and top_k [R], got {tuple(logits.shape)}, "
            f"{tuple(settings.shape)} and {tuple(top_k.shape)}"
        )
    return ext.sample_rows(
        logits, settings.float().contiguous(), top_k.to(torch.int64).contiguous()
    )


# ggml type id -> (elements, bytes) per block, for the types `dequantize_gguf` covers: F16,
# BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (gguf.GGML_QUANT_SIZES).
_GGUF_BLOCKS: dict[int, tuple[int, int]] = {
    1: (1, 2),
    30: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    10: (256, 84),
    11: (256, 110),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
}
GGUF_DEQUANT_TYPES: frozenset[int] = frozenset(_GGUF_BLOCKS)


def dequantize_gguf(raw: torch.Tensor, ggml_type: int, out: torch.Tensor) -> bool:
    """Write the fp32 values of GGUF rows raw (uint8 [R, bytes per row], each row's blocks as
    stored in the file) into out (fp32 [R, C]) in C++, the same bits as gguf-py's numpy
    `dequantize`. False (out untouched) where the type is not in `GGUF_DEQUANT_TYPES` or the
    C++ kernels are not built: the caller dequantizes with numpy."""
    block = _GGUF_BLOCKS.get(ggml_type)
    if block is None:
        return False
    size, nbytes = block
    if raw.dtype != torch.uint8 or out.dtype != torch.float32 or raw.dim() != 2 or out.dim() != 2:
        raise KernelError(
            f"need raw uint8 [R, B] and out float32 [R, C], got {raw.dtype} "
            f"{tuple(raw.shape)} and {out.dtype} {tuple(out.shape)}"
        )
    rows, cols = out.shape
    if cols % size != 0 or tuple(raw.shape) != (rows, cols // size * nbytes):
        raise KernelError(
            f"ggml type {ggml_type} rows of {cols} values take {cols // size * nbytes} bytes "
            f"({nbytes} per {size}) and must be whole blocks: raw {tuple(raw.shape)} does not "
            f"fit out {tuple(out.shape)}"
        )
    if not (raw.is_cpu and out.is_cpu and raw.is_contiguous() and out.is_contiguous()):
        raise KernelError("raw and out must be contiguous CPU tensors")
    from kvrelay.kernels import cpu_build

    ext = cpu_build.load()
    if ext is None:
        return False
    ext.dequantize_gguf(raw, ggml_type, out)
    return True
