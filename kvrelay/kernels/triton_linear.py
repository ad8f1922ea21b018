"""Triton row-invariant GEMM: y = x W^T (+ b) with one fixed tile configuration for every M.

cuBLAS picks its algorithm (tile shape, split-K) from the problem size, so a row of F.linear
changes with the number of rows beside it. Here row r is always computed by the program of
M-tile r // BLOCK_M at position r % BLOCK_M of the same tile shape, from the same launch
configuration, walking K in BLOCK_K steps 0, 1, 2, ... into one fp32 accumulator (no
autotuning, no split-K). An MMA's output element depends only on its own row of x and column
of W, and masked rows load zeros, so a row is bitwise the same for any M: batch 1 vs 32, decode
vs a prefill over the same positions. M is not specialized (`do_not_specialize`): one compiled
kernel serves every row count. fp32 inputs use exact ("ieee") dots, never TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.errors import KernelError

# The one tile configuration (a module constant so it can be tuned; changing it changes bits).
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    sx_m,
    sw_n,
    so_m,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx_m
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * sw_n
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o_off = rm.to(tl.int64)[:, None] * so_m + rn[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] . weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise KernelError(
            f"need x [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise KernelError(
            f"x and weight need one dtype of {DTYPES}, got {x.dtype} and {weight.dtype}"
        )
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise KernelError("linear needs x with a contiguous last dimension and a contiguous weight")
    (m, k), n = x.shape, weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise KernelError(f"bias must be [{n}], got {tuple(bias.shape)}")
    out = x.new_empty((m, n))
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))
    _linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
        # fp32 dots must not drop to TF32; for 16-bit inputs the setting does not apply.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out
