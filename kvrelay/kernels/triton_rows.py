"""Triton row-wise ops: RMSNorm, and the residual add fused with it.

One program per row with BLOCK = next_power_of_2(D) and a warp count set by D alone, so a
row's sum of squares is reduced in the same order whatever the number of rows (torch's CUDA
reduction may pick its strategy from the row count). fp32 math; like torch's rms_norm the
normalized row is rounded to x's dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.errors import KernelError


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    d_ptr,
    w_ptr,
    out_ptr,
    sx,
    sd,
    so,
    D,
    eps,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0)
    if ADD:  # residual += delta, rounded to the residual's dtype like torch's add_
        delta = tl.load(d_ptr + row * sd + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * sx + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    if x.dim() != 2 or x.stride(1) != 1 or (delta is not None and delta.stride(1) != 1):
        raise KernelError("the Triton RMSNorm needs [T, D] rows with a contiguous last dimension")
    rows, dim = x.shape
    if tuple(weight.shape) != (dim,):
        raise KernelError(f"weight must be [{dim}], got {tuple(weight.shape)}")
    out = torch.empty(
        (rows, dim), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
    )
    if rows == 0 or dim == 0:
        return out
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows,)](
        x,
        x if delta is None else delta,
        weight.contiguous(),
        out,
        x.stride(0),
        0 if delta is None else delta.stride(0),
        out.stride(0),
        dim,
        eps,
        ADD=delta is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, D] (a new tensor)."""
    return _launch(x, None, weight, eps)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += delta (in place), then RMSNorm of each row of the sum (a new tensor)."""
    return _launch(residual, delta, weight, eps)
